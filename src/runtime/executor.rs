//! One rank's executor: runs its program op by op on a backend, talking to the other
//! ranks only through its communicator, with a KV cache per attention op.

use super::backend::{Backend, BinaryOp};
use super::comm::Communicator;
use super::packed::PackedMatrix;
use super::rope;
use super::tensor::{pool, Tensor};
use super::weights::{load_slice, WeightSource};
use crate::error::{Result, TpcError};
use crate::ir::{Groups, InputKind, Op, RopeOp, WeightOrder};
use crate::plan::{Instr, RankProgram};
use std::collections::HashMap;

enum Value {
    Ids(Vec<i64>),
    F(Tensor),
}

/// A rank with its weights loaded and its KV cache.
pub struct RankExecutor<'a, B: Backend, C: Communicator> {
    program: &'a RankProgram,
    backend: &'a B,
    pub comm: C,
    tp: usize,
    /// Weights by value id.
    params: HashMap<u32, Tensor>,
    /// Linear weights packed for the GEMM (bf16 or f32 by compute dtype), by value id.
    linears: HashMap<u32, PackedMatrix>,
    /// Keys and values seen so far, per attention op.
    cache: HashMap<u32, (Vec<f32>, Vec<f32>)>,
    /// Tokens already in the cache.
    pub position: usize,
    /// The linears that compute the output (the LM head): only row-wise ops lie between
    /// them and it, so they may run on the last row alone.
    head_linears: Vec<u32>,
    last_only: bool,
    /// Per value id, the index of the last instruction that reads it (`usize::MAX`: none):
    /// a value is released there, and an elementwise op that is its last reader works in
    /// place on it instead of on a copy.
    last_use: Vec<usize>,
    values: Vec<Option<Value>>,
    /// Time and calls per op kind, when profiling.
    pub profile: Option<HashMap<&'static str, (std::time::Duration, u64)>>,
}

fn bad(i: &Instr, problem: impl Into<String>) -> TpcError {
    TpcError::BadInstruction {
        name: i.name.to_string(),
        problem: problem.into(),
    }
}

impl<'a, B: Backend, C: Communicator> RankExecutor<'a, B, C> {
    /// Loads this rank's weight slices; with `bf16_linears`, linear weights stay bf16.
    pub fn new(
        program: &'a RankProgram,
        weights: &dyn WeightSource,
        backend: &'a B,
        comm: C,
        bf16_linears: bool,
    ) -> Result<Self> {
        let slices: HashMap<&str, &crate::plan::WeightSlice> =
            program.weights.iter().map(|w| (&*w.tensor, w)).collect();
        // How each weight is used: as a linear weight (in its stored order) or otherwise.
        let mut linear_use: HashMap<u32, WeightOrder> = HashMap::new();
        let mut other_use: std::collections::HashSet<u32> = Default::default();
        for i in &program.instrs {
            for (slot, &id) in i.inputs.iter().enumerate() {
                match (&i.op, slot) {
                    (Op::Linear(l), 1) => {
                        linear_use.insert(id, l.weight_order);
                    }
                    _ => {
                        other_use.insert(id);
                    }
                }
            }
        }
        let mut params = HashMap::new();
        let mut linears = HashMap::new();
        for i in &program.instrs {
            if let Op::Param(p) = &i.op {
                let w = slices
                    .get(&*p.tensor)
                    .ok_or_else(|| bad(i, "its weight is not in the rank's manifest"))?;
                let t = load_slice(weights, w)?;
                match linear_use.get(&i.id) {
                    Some(&order) if t.shape.len() == 2 => {
                        linears.insert(i.id, PackedMatrix::pack(&t, order, bf16_linears));
                        if other_use.contains(&i.id) {
                            params.insert(i.id, t);
                        }
                    }
                    _ => {
                        params.insert(i.id, t);
                    }
                }
            }
        }
        let tp = comm.world_size();
        let head_linears = head_linears(program);
        let max_id = program.instrs.iter().map(|i| i.id).max().unwrap_or(0) as usize;
        let mut last_use = vec![usize::MAX; max_id + 1];
        for (idx, i) in program.instrs.iter().enumerate() {
            for &id in &i.inputs {
                if let Some(l) = last_use.get_mut(id as usize) {
                    *l = idx;
                }
            }
        }
        Ok(RankExecutor {
            program,
            backend,
            comm,
            tp,
            params,
            linears,
            cache: HashMap::new(),
            head_linears,
            last_only: false,
            last_use,
            values: Vec::new(),
            profile: None,
            position: 0,
        })
    }

    /// Reserves KV-cache room for `positions` tokens so that decoding never grows it.
    pub fn reserve_positions(&mut self, positions: usize) {
        for i in &self.program.instrs {
            if let (Op::Attention(_), Some(&k)) = (&i.op, i.inputs.get(1)) {
                let Some(width) = self
                    .program
                    .instrs
                    .iter()
                    .find(|x| x.id == k)
                    .map(|x| x.fact.shape.fixed_elements())
                else {
                    continue;
                };
                let (kc, vc) = self.cache.entry(i.id).or_default();
                let want = positions.saturating_mul(width as usize);
                // Only an optimisation: if the memory is not there (an absurd token limit),
                // the cache grows as it goes and fails, if it must, with the first real need.
                let _ = kc.try_reserve(want.saturating_sub(kc.len()));
                let _ = vc.try_reserve(want.saturating_sub(vc.len()));
            }
        }
    }

    /// Forgets every cached token (keeping the cache's memory) to start a new sequence.
    pub fn reset(&mut self) {
        for (k, v) in self.cache.values_mut() {
            k.clear();
            v.clear();
        }
        self.position = 0;
    }

    /// Runs the program on `ids` (continuing after the tokens already cached) and returns
    /// the model output (logits `[ids.len(), vocab]`).
    pub fn forward(&mut self, ids: &[i64]) -> Result<Tensor> {
        self.forward_rows(ids, false)
    }

    /// As [`RankExecutor::forward`]; with `last_only` the output is the last row's alone
    /// (`[1, vocab]`) and the LM head computes nothing else.
    pub fn forward_rows(&mut self, ids: &[i64], last_only: bool) -> Result<Tensor> {
        self.last_only = last_only;
        let start = self.position;
        let positions: Vec<i64> = (start..start + ids.len()).map(|p| p as i64).collect();
        // The value table is kept between calls (its slots are all empty in between).
        let mut values = std::mem::take(&mut self.values);
        values.resize_with(self.last_use.len(), || None);
        let mut ropes: HashMap<RopeOp, super::backend::RopeTables> = HashMap::new();
        let mut output = None;
        for (idx, i) in self.program.instrs.iter().enumerate() {
            let value = match &i.op {
                Op::Param(_) => continue,
                Op::Input(inp) => Value::Ids(match inp.kind {
                    InputKind::TokenIds => ids.to_vec(),
                    InputKind::Positions => positions.clone(),
                }),
                Op::Output(_) => {
                    output = Some(self.take_or_copy(&mut values, idx, i)?);
                    continue;
                }
                op => {
                    let started = self.profile.is_some().then(std::time::Instant::now);
                    let v = self.run(op, idx, i, &mut values, &positions, &mut ropes)?;
                    if let (Some(t), Some(p)) = (started, self.profile.as_mut()) {
                        let e = p.entry(op.kind()).or_default();
                        e.0 += t.elapsed();
                        e.1 += 1;
                    }
                    Value::F(v)
                }
            };
            values[i.id as usize] = Some(value);
            // Inputs read for the last time go back to the pool.
            for &id in &i.inputs {
                if self.last_use.get(id as usize) == Some(&idx) {
                    if let Some(Some(Value::F(t))) = values.get_mut(id as usize).map(Option::take) {
                        t.release();
                    }
                }
            }
        }
        for v in values.iter_mut().filter_map(Option::take) {
            if let Value::F(t) = v {
                t.release();
            }
        }
        self.values = values;
        self.position += ids.len();
        output.ok_or_else(|| TpcError::BadInstruction {
            name: "program".into(),
            problem: "it has no output".into(),
        })
    }

    fn ids<'v>(&self, values: &'v [Option<Value>], i: &Instr, slot: usize) -> Result<&'v [i64]> {
        let id = i.inputs[slot] as usize;
        match values.get(id) {
            Some(Some(Value::Ids(v))) => Ok(v),
            _ => Err(bad(i, format!("input %{id} is not token ids"))),
        }
    }

    /// Input 0 of instruction `idx` as an owned tensor: the value itself when this is its
    /// last reader (and it is not read twice here), else a pooled copy.
    fn take_or_copy(&self, values: &mut [Option<Value>], idx: usize, i: &Instr) -> Result<Tensor> {
        let id = *i
            .inputs
            .first()
            .ok_or_else(|| bad(i, "input 0 is missing"))?;
        let last = self.last_use.get(id as usize) == Some(&idx)
            && i.inputs.iter().filter(|&&x| x == id).count() == 1
            && !self.params.contains_key(&id);
        if last {
            if let Some(slot) = values.get_mut(id as usize) {
                if let Some(Value::F(t)) = slot.take() {
                    return Ok(t);
                }
            }
        }
        Ok(input_tensor(&self.params, values, i, 0)?.pooled_copy())
    }

    fn run(
        &mut self,
        op: &Op,
        idx: usize,
        i: &Instr,
        values: &mut [Option<Value>],
        positions: &[i64],
        ropes: &mut HashMap<RopeOp, super::backend::RopeTables>,
    ) -> Result<Tensor> {
        // Elementwise ops write into their first input when nothing reads it later.
        let in_place = matches!(
            op,
            Op::BiasAdd(_)
                | Op::Add(_)
                | Op::Mul(_)
                | Op::Activation(_)
                | Op::Rope(_)
                | Op::AllReduce(_)
        );
        let mut first = if in_place {
            Some(self.take_or_copy(values, idx, i)?)
        } else {
            None
        };
        let mut owned = || {
            first
                .take()
                .ok_or_else(|| bad(i, "input 0 was already used"))
        };
        let values: &[Option<Value>] = values;
        let b = self.backend;
        let params = &self.params;
        let t = |slot| input_tensor(params, values, i, slot);
        Ok(match op {
            Op::Embedding(e) => {
                let ids = self.ids(values, i, 0)?;
                let table = t(1)?;
                let (rows, cols) = table.rows_cols();
                let (offset, len) = e
                    .vocab_range
                    .map(|(o, l)| (o as usize, l as usize))
                    .unwrap_or((0, rows));
                let mut out = Tensor::zeros(vec![ids.len(), cols]);
                for (r, &id) in ids.iter().enumerate() {
                    let id = id as usize;
                    // Ids outside this rank's rows contribute zeros; the all-reduce adds the rest.
                    if id >= offset && id < offset + len {
                        let row = &table.data[(id - offset) * cols..(id - offset + 1) * cols];
                        out.data[r * cols..(r + 1) * cols].copy_from_slice(row);
                    }
                }
                out
            }
            Op::Linear(l) => {
                let x = t(0)?;
                // The LM head of a generation step needs the last row only.
                let last =
                    (self.last_only && x.rows_cols().0 > 1 && self.head_linears.contains(&i.id))
                        .then(|| x.last_row());
                let x = last.as_ref().unwrap_or(x);
                let y = match self.linears.get(&i.inputs[1]) {
                    Some(w) if x.cols() != w.k => {
                        return Err(bad(
                            i,
                            format!(
                                "{} input features against a weight of {} inputs",
                                x.cols(),
                                w.k
                            ),
                        ))
                    }
                    Some(w) => b.packed_linear(x, w),
                    None => b.linear(x, t(1)?, l.weight_order),
                };
                if let Some(last) = last {
                    last.release();
                }
                y
            }
            Op::BiasAdd(_) => {
                let (mut out, bias) = (owned()?, t(1)?);
                let n = bias.data.len();
                for row in out.data.chunks_mut(n) {
                    row.iter_mut().zip(&bias.data).for_each(|(o, b)| *o += b);
                }
                out
            }
            Op::Add(_) | Op::Mul(_) => {
                let (mut out, y) = (owned()?, t(1)?);
                if out.data.len() != y.data.len() {
                    return Err(bad(
                        i,
                        format!(
                            "operands of {} and {} elements",
                            out.data.len(),
                            y.data.len()
                        ),
                    ));
                }
                let kind = if matches!(op, Op::Add(_)) {
                    BinaryOp::Add
                } else {
                    BinaryOp::Mul
                };
                b.binary(&mut out, y, kind);
                out
            }
            Op::Activation(a) => {
                let mut out = owned()?;
                b.activation(&mut out, a.kind);
                out
            }
            Op::RmsNorm(n) => {
                let x = t(0)?;
                let group = n.group.map(|g| g as usize).unwrap_or(x.cols());
                b.rms_norm(x, &t(1)?.data, group, n.eps.0 as f32)
            }
            Op::LayerNorm(n) => b.layer_norm(t(0)?, &t(1)?.data, &t(2)?.data, n.eps.0 as f32),
            Op::Rope(r) => {
                let mut out = owned()?;
                let tables = ropes
                    .entry(r.clone())
                    .or_insert_with(|| rope::tables(r, positions));
                b.rope(&mut out, r.head_dim as usize, tables);
                out
            }
            Op::Attention(a) => {
                let d = a.head_dim as usize;
                let (q, k, v) = (t(0)?, t(1)?, t(2)?);
                let kv_heads = k.cols() / d;
                let (kc, vc) = self.cache.entry(i.id).or_default();
                kc.extend_from_slice(&k.data);
                vc.extend_from_slice(&v.data);
                let scale = a
                    .scale
                    .map(|s| s.0 as f32)
                    .unwrap_or(1.0 / (d as f32).sqrt());
                let (kc, vc) = &self.cache[&i.id];
                b.attention(q, kc, vc, d, kv_heads, scale)
            }
            Op::Unfuse(u) => unfuse(t(0)?, &u.groups, u.part as usize)
                .ok_or_else(|| bad(i, "its structure does not fit its input"))?,
            Op::AllReduce(_) => {
                let mut out = owned()?;
                self.comm.all_reduce_sum(&mut out.data)?;
                out
            }
            Op::AllGather(g) => {
                let x = t(0)?;
                let (rows, n) = x.rows_cols();
                let mut gathered = pool::take(x.data.len() * self.tp);
                self.comm.all_gather(&x.data, &mut gathered)?;
                // Rank-major pieces [tp][rows][n] → [rows][tp·n], then drop vocab padding.
                let keep = g.unpad_to.map(|u| u as usize).unwrap_or(n * self.tp);
                let mut out = pool::empty(rows * keep);
                for r in 0..rows {
                    let row_start = out.len();
                    for k in 0..self.tp {
                        out.extend_from_slice(
                            &gathered[(k * rows + r) * n..(k * rows + r + 1) * n],
                        );
                    }
                    out.truncate(row_start + keep);
                }
                pool::give(gathered);
                x.with_cols(keep, out)
            }
            Op::ReduceScatter(_) => {
                // Rank-major pieces for the communicator: [tp][rows][n / tp].
                let x = t(0)?;
                let mut arranged = pool::empty(x.data.len());
                for k in 0..self.tp {
                    x.push_column_block(k, self.tp, &mut arranged);
                }
                let mut out = pool::take(x.data.len() / self.tp);
                self.comm.reduce_scatter_sum(&arranged, &mut out)?;
                pool::give(arranged);
                x.with_cols(x.cols() / self.tp, out)
            }
            Op::LocalSlice(_) => {
                let x = t(0)?;
                let mut out = pool::empty(x.data.len() / self.tp);
                x.push_column_block(self.comm.rank(), self.tp, &mut out);
                x.with_cols(x.cols() / self.tp, out)
            }
            Op::Param(_) | Op::Input(_) | Op::Output(_) => {
                return Err(bad(i, "is not a compute op"))
            }
        })
    }
}

/// The linears whose outputs reach the program's output through row-wise ops only.
fn head_linears(program: &RankProgram) -> Vec<u32> {
    let by_id: HashMap<u32, &Instr> = program.instrs.iter().map(|i| (i.id, i)).collect();
    let mut heads = Vec::new();
    let mut stack: Vec<u32> = program
        .instrs
        .iter()
        .filter(|i| matches!(i.op, Op::Output(_)))
        .flat_map(|i| i.inputs.first().copied())
        .collect();
    while let Some(id) = stack.pop() {
        let Some(i) = by_id.get(&id) else { continue };
        match &i.op {
            Op::Linear(_) => heads.push(id),
            // Row-wise: each output row depends on the same input row only (parameters
            // aside), so slicing rows before them equals slicing after.
            Op::BiasAdd(_) | Op::AllGather(_) | Op::AllReduce(_) | Op::Activation(_) => {
                stack.push(i.inputs[0])
            }
            // Anything else (attention, norms of a residual stream reused elsewhere, ...)
            // would need its other inputs sliced too: leave this path at full rows.
            _ => return Vec::new(),
        }
    }
    heads
}

fn input_tensor<'v>(
    params: &'v HashMap<u32, Tensor>,
    values: &'v [Option<Value>],
    i: &Instr,
    slot: usize,
) -> Result<&'v Tensor> {
    let id = *i
        .inputs
        .get(slot)
        .ok_or_else(|| bad(i, format!("input {slot} is missing")))?;
    if let Some(t) = params.get(&id) {
        return Ok(t);
    }
    match values.get(id as usize) {
        Some(Some(Value::F(t))) => Ok(t),
        _ => Err(bad(i, format!("input %{id} is not a computed tensor"))),
    }
}

/// Part `part` of a fused last dim.
fn unfuse(x: &Tensor, groups: &Groups, part: usize) -> Option<Tensor> {
    let (rows, n) = x.rows_cols();
    // (offset, len) of the part inside each repeating block of `block` columns.
    let (block, offset, len) = match groups {
        Groups::Concat(parts) => {
            let lens: Vec<u64> = parts
                .iter()
                .map(|p| p.covered_len())
                .collect::<Option<_>>()?;
            let offset: u64 = lens[..part].iter().sum();
            (n, offset as usize, *lens.get(part)? as usize)
        }
        Groups::Interleaved { heads, parts } => {
            let block: u64 = parts.iter().sum();
            let offset: u64 = parts[..part].iter().sum();
            if block * heads != n as u64 {
                return None;
            }
            (block as usize, offset as usize, *parts.get(part)? as usize)
        }
        _ => return None,
    };
    if offset + len > block || n % block != 0 {
        return None;
    }
    let mut out = pool::empty(rows * n / block * len);
    for chunk in x.data.chunks(block) {
        out.extend_from_slice(&chunk[offset..offset + len]);
    }
    let mut shape = x.shape.clone();
    *shape.last_mut()? = n / block * len;
    Some(Tensor::new(shape, out))
}
