//! A mixture-of-experts layer whose experts are dealt over data-parallel replicas
//! (`--dp D --ep`, `expert_exchange`): this tp rank's routing columns are shared out among
//! the D members of its DP group. Dispatch sends each member the rows routed to its columns
//! (with their routing weights), each member runs its experts over every row it got (one
//! product per chosen expert, `moe::run_experts`), and combine sends each row's result back
//! to the replica it came from, which adds the members' answers in member order.

use super::backend::{Activation, Backend, BackendError};
use super::expert_exchange::{deal_columns, ExchangeError, ExpertMember, Parcel};
use super::moe::{run_experts, ExpertWeights};
use super::tensor::Tensor;
use crate::ir::ActivationKind;

#[derive(Debug, thiserror::Error)]
pub enum AcrossError {
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error(transparent)]
    Exchange(#[from] ExchangeError),
}

type Across<T> = Result<T, AcrossError>;

fn shape(problem: String) -> AcrossError {
    AcrossError::Backend(BackendError::Shape(problem))
}

/// The columns member `member` of `members` computes, out of `columns` routing columns.
pub fn my_columns(columns: usize, m: &ExpertMember) -> std::ops::Range<usize> {
    deal_columns(columns, m.exchange.members())
        .get(m.member)
        .cloned()
        .unwrap_or(0..0)
}

/// Runs this member's experts (`experts[mine]`) over every member's dispatched rows and
/// returns each member's answer (its rows' weighted sums, in its order) and the (token,
/// expert) pairs computed.
pub fn answer<B: Backend + ?Sized>(
    b: &B,
    dispatched: &[Parcel],
    experts: &[Option<ExpertWeights<B::Weight>>],
    act: ActivationKind,
) -> Across<(Vec<Parcel>, u64)> {
    let rows: usize = dispatched.iter().map(|p| p.rows).sum();
    let columns = experts.len();
    if rows == 0 {
        return Ok((vec![Parcel::default(); dispatched.len()], 0));
    }
    let width = dispatched
        .iter()
        .find(|p| p.rows > 0)
        .map_or(0, |p| p.values.len() / p.rows);
    let mut values = Vec::with_capacity(rows * width);
    let mut routing = Vec::with_capacity(rows * columns);
    for (from, p) in dispatched.iter().enumerate() {
        if p.values.len() != p.rows * width || p.routing.len() != p.rows * columns {
            return Err(shape(format!(
                "member {from} sent {} values and {} routing weights for {} rows of width {width} and {columns} experts",
                p.values.len(),
                p.routing.len(),
                p.rows
            )));
        }
        values.extend_from_slice(&p.values);
        routing.extend_from_slice(&p.routing);
    }
    let x = b.upload_host(&Tensor::new(vec![rows, width], values))?;
    let routing = Tensor::new(vec![rows, columns], routing);
    let done = run_experts(b, &x, &routing, experts, act);
    b.release(x);
    let (y, pairs) = done?;
    let y = b.to_host(y)?;
    let mut start = 0;
    let answers = dispatched
        .iter()
        .map(|p| {
            let values = y.data[start * width..(start + p.rows) * width].to_vec();
            start += p.rows;
            Parcel {
                rows: p.rows,
                values,
                routing: Vec::new(),
            }
        })
        .collect();
    Ok((answers, pairs))
}

/// The layer for this replica's rows `x` with its routing over this tp rank's columns:
/// dispatch, answer the others, combine. Returns the rank's partial output (as
/// `run_experts` would with every column's experts here) and the pairs this member computed.
pub fn experts_across<B: Backend + ?Sized>(
    b: &B,
    m: &ExpertMember,
    x: &B::Act,
    routing: &Tensor,
    experts: &[Option<ExpertWeights<B::Weight>>],
    act: ActivationKind,
) -> Across<(B::Act, u64)> {
    let (rows, width) = x.rows_cols();
    let (routed, columns) = routing.rows_cols();
    if routed != rows || columns != experts.len() {
        return Err(shape(format!(
            "routing of {routed} rows × {columns} experts for {rows} rows and {} experts on this rank",
            experts.len()
        )));
    }
    let host = b.to_host(b.copy(x)?)?;
    let deal = deal_columns(columns, m.exchange.members());
    // Per member, the rows with a weight on one of its columns, and their parcel.
    let mut sent_rows: Vec<Vec<usize>> = Vec::with_capacity(deal.len());
    let mut parcels = Vec::with_capacity(deal.len());
    for cols in &deal {
        let mut picked = Vec::new();
        let mut parcel = Parcel::default();
        for (r, weights) in routing.data.chunks_exact(columns.max(1)).enumerate() {
            let mine = &weights[cols.clone()];
            if mine.iter().any(|&w| w != 0.0) {
                picked.push(r);
                parcel
                    .values
                    .extend_from_slice(&host.data[r * width..(r + 1) * width]);
                parcel.routing.extend_from_slice(mine);
            }
        }
        parcel.rows = picked.len();
        sent_rows.push(picked);
        parcels.push(parcel);
    }
    let round = m.exchange.all_to_all(m.member, parcels, false)?;
    let mine = deal.get(m.member).cloned().unwrap_or(0..0);
    let (answers, pairs) = answer(b, &round.parcels, &experts[mine], act)?;
    let back = m.exchange.all_to_all(m.member, answers, false)?;
    let mut out = vec![0f32; rows * width];
    for (from, (picked, p)) in sent_rows.iter().zip(&back.parcels).enumerate() {
        if p.rows != picked.len() || p.values.len() != p.rows * width {
            return Err(shape(format!(
                "member {from} answered {} rows ({} values) for the {} rows sent to it",
                p.rows,
                p.values.len(),
                picked.len()
            )));
        }
        for (k, &r) in picked.iter().enumerate() {
            let dst = &mut out[r * width..(r + 1) * width];
            for (d, s) in dst.iter_mut().zip(&p.values[k * width..(k + 1) * width]) {
                *d += s;
            }
        }
    }
    let y = b.upload_host(&Tensor::new(vec![rows, width], out))?;
    Ok((y, pairs))
}

/// One layer's round for a member with no rows of its own: answers the others. `done`:
/// this member will have no rows again (else it answers while it waits for requests).
/// Returns `None` when every member was done (the end), else the pairs computed.
pub fn serve_layer<B: Backend + ?Sized>(
    b: &B,
    m: &ExpertMember,
    experts: &[Option<ExpertWeights<B::Weight>>],
    act: ActivationKind,
    done: bool,
) -> Across<Option<u64>> {
    let members = m.exchange.members();
    let round = m
        .exchange
        .all_to_all(m.member, vec![Parcel::default(); members], done)?;
    if round.all_idle {
        return Ok(None);
    }
    let mine = my_columns(experts.len(), m);
    let (answers, pairs) = answer(b, &round.parcels, &experts[mine], act)?;
    m.exchange.all_to_all(m.member, answers, done)?;
    Ok(Some(pairs))
}
