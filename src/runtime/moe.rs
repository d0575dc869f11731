//! Mixture-of-experts on any backend: the router's choice on the host (a few values per
//! token), then, per expert that some token chose, one product over just those tokens.
//! A decode step thus reads the weights of the chosen experts only.

use super::backend::{Backend, BackendError, BackendResult, BinaryOp};
use super::tensor::Tensor;
use crate::ir::ActivationKind;

/// The router of one layer over `logits [rows, experts]`: per row, the softmax (in f32, as
/// transformers computes it), the `top_k` largest kept (the lower expert first among equal
/// values, so that every rank and every run picks the same) and, with `normalize`, divided
/// by their sum. Every other expert's weight is zero.
pub fn route(logits: &Tensor, top_k: usize, normalize: bool) -> BackendResult<Tensor> {
    let (rows, experts) = logits.rows_cols();
    if top_k == 0 || top_k > experts {
        return Err(BackendError::Shape(format!(
            "a router keeping {top_k} of {experts} experts per token"
        )));
    }
    let mut out = vec![0f32; rows * experts];
    let mut order: Vec<usize> = Vec::with_capacity(experts);
    for (row, dst) in logits
        .data
        .chunks_exact(experts)
        .zip(out.chunks_exact_mut(experts))
    {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let exp: Vec<f32> = row.iter().map(|&v| (v - max).exp()).collect();
        let total: f32 = exp.iter().sum();
        order.clear();
        order.extend(0..experts);
        // Larger probability first; a NaN sorts last and is then never chosen over a number.
        order.sort_by(|&a, &b| {
            let (pa, pb) = (exp[a] / total, exp[b] / total);
            pb.partial_cmp(&pa)
                .unwrap_or_else(|| pa.is_nan().cmp(&pb.is_nan()))
                .then(a.cmp(&b))
        });
        let kept = &order[..top_k];
        let sum: f32 = kept.iter().map(|&e| exp[e] / total).sum();
        for &e in kept {
            let p = exp[e] / total;
            dst[e] = if normalize { p / sum } else { p };
        }
    }
    Ok(Tensor::new(vec![rows, experts], out))
}

/// The rows routed to one expert, with their weights, in row order.
#[derive(Debug, Clone, PartialEq)]
pub struct ExpertRows {
    /// The expert's column in the routing this rank holds.
    pub expert: usize,
    pub rows: Vec<usize>,
    pub weights: Vec<f32>,
}

/// The experts some row gives a non-zero weight, each with its rows, in expert order. A
/// zero weight adds nothing, so an expert no token chose is never computed.
pub fn rows_by_expert(routing: &Tensor) -> Vec<ExpertRows> {
    let (_, experts) = routing.rows_cols();
    let mut by: Vec<ExpertRows> = (0..experts)
        .map(|expert| ExpertRows {
            expert,
            rows: Vec::new(),
            weights: Vec::new(),
        })
        .collect();
    for (r, row) in routing.data.chunks_exact(experts.max(1)).enumerate() {
        for (e, &w) in row.iter().enumerate() {
            if w != 0.0 {
                by[e].rows.push(r);
                by[e].weights.push(w);
            }
        }
    }
    by.retain(|e| !e.rows.is_empty());
    by
}

/// One expert's weights on a rank: gate and up side by side (one product), and down.
pub struct ExpertWeights<W> {
    pub gate_up: W,
    pub down: W,
    /// The expert's features on this rank (the width of each of gate and up).
    pub features: usize,
}

/// `Σ_e routing[e] · down_e(act(gate_e · x) ⊙ up_e · x)` over the experts this rank holds
/// (`experts[j]` is the routing's column `j`; `None` for a padding column no token can
/// choose). One product per chosen expert over the rows that chose it. Also returns the
/// (token, expert) pairs computed: the rank's load.
pub fn run_experts<B: Backend + ?Sized>(
    b: &B,
    x: &B::Act,
    routing: &Tensor,
    experts: &[Option<ExpertWeights<B::Weight>>],
    act: ActivationKind,
) -> BackendResult<(B::Act, u64)> {
    let (rows, width) = super::backend::Activation::rows_cols(x);
    let (routed, columns) = routing.rows_cols();
    if routed != rows || columns != experts.len() {
        return Err(BackendError::Shape(format!(
            "routing of {routed} rows × {columns} experts for {rows} rows and {} experts on this rank",
            experts.len()
        )));
    }
    let mut outputs = Vec::new();
    let mut chosen = Vec::new();
    let result = (|| {
        for group in rows_by_expert(routing) {
            let w = experts[group.expert].as_ref().ok_or_else(|| {
                BackendError::Shape(format!(
                    "a token chose expert column {}, which is padding on this rank",
                    group.expert
                ))
            })?;
            let picked = b.select_rows(x, &group.rows)?;
            let both = b.linear(&picked, &w.gate_up);
            b.release(picked);
            let mut halves = b.split_columns(both?, &[w.features, w.features])?;
            let up = halves.pop();
            let gate = halves.pop();
            let (Some(mut gate), Some(up)) = (gate, up) else {
                return Err(BackendError::Shape("gate|up product split".into()));
            };
            let done = b
                .activation(&mut gate, act)
                .and_then(|()| b.binary(&mut gate, &up, BinaryOp::Mul));
            b.release(up);
            if let Err(e) = done {
                b.release(gate);
                return Err(e);
            }
            let y = b.linear(&gate, &w.down);
            b.release(gate);
            outputs.push(y?);
            chosen.push(group);
        }
        let parts: Vec<(&B::Act, &[usize], &[f32])> = outputs
            .iter()
            .zip(&chosen)
            .map(|(y, g)| (y, g.rows.as_slice(), g.weights.as_slice()))
            .collect();
        let pairs: usize = chosen.iter().map(|g| g.rows.len()).sum();
        Ok((b.weighted_rows_sum(rows, width, &parts)?, pairs as u64))
    })();
    for y in outputs {
        b.release(y);
    }
    result
}

/// `x ⊙ σ(gate)`, one gate value per row of `x` (`gate [rows, 1]`, on the host): a shared
/// expert's output scaled by its gate, as one weighted sum of all rows.
pub fn sigmoid_gate<B: Backend + ?Sized>(
    b: &B,
    x: &B::Act,
    gate: &Tensor,
) -> BackendResult<B::Act> {
    let (rows, width) = super::backend::Activation::rows_cols(x);
    if gate.rows_cols() != (rows, 1) {
        return Err(BackendError::Shape(format!(
            "a gate of shape {:?} for {rows} rows; it must be [{rows}, 1]",
            gate.shape
        )));
    }
    let every: Vec<usize> = (0..rows).collect();
    // σ in f32 as transformers computes it.
    let weights: Vec<f32> = gate
        .data
        .iter()
        .map(|&g| 1.0 / (1.0 + (-g).exp()))
        .collect();
    b.weighted_rows_sum(rows, width, &[(x, &every, &weights)])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(rows: usize, data: Vec<f32>) -> Tensor {
        let cols = data.len() / rows;
        Tensor::new(vec![rows, cols], data)
    }

    #[test]
    fn route_keeps_the_top_k_softmax_weights() {
        let r = route(&t(1, vec![1.0, 3.0, 2.0, 0.0]), 2, false).unwrap();
        let e: Vec<f32> = [1.0f32, 3.0, 2.0, 0.0].iter().map(|v| v.exp()).collect();
        let total: f32 = e.iter().sum();
        assert_eq!(r.data[0], 0.0);
        assert_eq!(r.data[3], 0.0);
        assert!((r.data[1] - e[1] / total).abs() < 1e-7);
        assert!((r.data[2] - e[2] / total).abs() < 1e-7);
        let n = route(&t(1, vec![1.0, 3.0, 2.0, 0.0]), 2, true).unwrap();
        assert!((n.data[1] + n.data[2] - 1.0).abs() < 1e-6);
        assert!((n.data[1] / n.data[2] - (1.0f32).exp()).abs() < 1e-5);
    }

    #[test]
    fn ties_go_to_the_lower_expert() {
        let r = route(&t(1, vec![0.5, 2.0, 2.0, 2.0]), 2, true).unwrap();
        assert_eq!(r.data, vec![0.0, 0.5, 0.5, 0.0]);
    }

    #[test]
    fn top_k_of_every_expert_keeps_the_whole_softmax() {
        let r = route(&t(2, vec![0.0, 1.0, 2.0, -1.0, 0.0, 4.0]), 3, false).unwrap();
        for row in r.data.chunks(3) {
            assert!(row.iter().all(|&p| p > 0.0));
            assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        }
    }

    #[test]
    fn a_top_k_that_does_not_fit_is_an_error() {
        assert!(route(&t(1, vec![0.0, 1.0]), 0, true).is_err());
        assert!(route(&t(1, vec![0.0, 1.0]), 3, true).is_err());
    }

    #[test]
    fn rows_are_grouped_by_the_experts_they_chose() {
        // Three tokens, four experts; expert 2 is chosen by none, expert 1 by all.
        let routing = t(
            3,
            vec![
                0.5, 0.5, 0.0, 0.0, //
                0.0, 0.3, 0.0, 0.7, //
                0.2, 0.8, 0.0, 0.0,
            ],
        );
        let g = rows_by_expert(&routing);
        let experts: Vec<usize> = g.iter().map(|e| e.expert).collect();
        assert_eq!(experts, vec![0, 1, 3]);
        assert_eq!(g[0].rows, vec![0, 2]);
        assert_eq!(g[0].weights, vec![0.5, 0.2]);
        assert_eq!(g[1].rows, vec![0, 1, 2]);
        assert_eq!(g[2].rows, vec![1]);
    }
}
