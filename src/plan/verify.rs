//! `Plan::verify`: a plan is a contract between the compiler and the runtime. A saved plan
//! may be corrupted or edited by hand, so before anything runs it, every rank program is
//! checked on its own (ids, inputs, arity, local facts, weight manifest) and the ranks
//! against each other (the same op under one id, the same reading of each checkpoint
//! tensor, the same collectives in the same order). Every problem is collected; nothing
//! here trusts a size or an id from the plan to allocate or index.

use super::{Instr, Plan, RankProgram, WeightSlice, PLAN_VERSION};
use crate::error::plan::{Issued, Place, PlanError, PlanProblem, Problem, WeightKey, MAX_LISTED};
use crate::ir::shape::infer;
use crate::ir::{
    op::Cut, AllGatherOp, Dim, LocalSliceOp, Op, ReduceScatterOp, Shape, SliceRange, TensorFact,
};
use smallvec::SmallVec;
use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet};

/// The problems found so far: the first [`MAX_LISTED`] in full, the rest counted.
#[derive(Default)]
struct Found {
    problems: Vec<PlanProblem>,
    unlisted: usize,
}

impl Found {
    fn say(&mut self, place: Place, problem: Problem) {
        if self.problems.len() < MAX_LISTED {
            self.problems.push(PlanProblem { place, problem });
        } else {
            self.unlisted += 1;
        }
    }
}

/// A collective one rank issues, with the instruction that issues it.
struct Issue<'a> {
    issued: Issued,
    instr: &'a Instr,
}

impl Plan {
    /// Checks that this plan holds together and fits the runtime; the error lists every
    /// problem, each at its rank and instruction (or weight entry, or listed collective).
    pub fn verify(&self) -> Result<(), PlanError> {
        let mut found = Found::default();
        check_header(self, &mut found);
        let limit = id_limit(self);
        let issued: Vec<Vec<Issue>> = self
            .ranks
            .iter()
            .enumerate()
            .map(|(r, program)| check_rank(self, r, program, limit, &mut found))
            .collect();
        check_same_ops(self, &mut found);
        check_tensors(self, &mut found);
        check_collective_order(&issued, &mut found);
        check_collective_list(self, issued.first().map_or(&[], Vec::as_slice), &mut found);
        numerics::check_numerics(self, &mut found);
        if found.problems.is_empty() {
            Ok(())
        } else {
            Err(PlanError {
                path: None,
                model: self.model.clone(),
                problems: found.problems,
                unlisted: found.unlisted,
            })
        }
    }
}

fn check_header(plan: &Plan, found: &mut Found) {
    if plan.version != PLAN_VERSION {
        found.say(
            Place::Plan,
            Problem::Version {
                found: plan.version,
                expected: PLAN_VERSION,
            },
        );
    }
    if plan.tp == 0 {
        found.say(Place::Plan, Problem::ZeroTp);
    }
    if plan.ranks.len() as u64 != plan.tp {
        found.say(
            Place::Plan,
            Problem::RankCount {
                tp: plan.tp,
                ranks: plan.ranks.len(),
            },
        );
    }
    // Stage programs are derived from the rank programs, which must then split at the
    // pipeline's layer boundaries.
    let stages = match (&plan.pipeline, plan.ranks.is_empty()) {
        (Some(_), false) => {
            (0..plan.pp()).try_for_each(|s| super::stages::stage_program(plan, 0, s).map(|_| ()))
        }
        (Some(_), true) => super::stages::check_spans(plan),
        (None, _) => Ok(()),
    };
    if let Err(e) = stages {
        found.say(Place::Plan, Problem::Pipeline(e.to_string()));
    }
    for (index, program) in plan.ranks.iter().enumerate() {
        if program.rank != index as u64 {
            found.say(
                Place::Rank { rank: index },
                Problem::RankNumber {
                    index,
                    found: program.rank,
                },
            );
        }
    }
}

/// How many distinct value ids the plan names. Partition numbers the model's values
/// 0..n in program order and every value runs on some rank, so every id lies below this;
/// the runtime relies on it, keeping values in a table indexed by id.
fn id_limit(plan: &Plan) -> u64 {
    let mut ids: HashSet<u32> = HashSet::new();
    for program in &plan.ranks {
        ids.extend(program.instrs.iter().map(|i| i.id));
    }
    ids.len() as u64
}

fn instr_place(rank: usize, i: &Instr) -> Place {
    Place::Instr {
        rank,
        id: i.id,
        name: i.name.clone(),
    }
}

/// Elements of a shape with symbolic dims counted once (per token for activations);
/// `None` when the product overflows.
fn elements(shape: &Shape) -> Option<u64> {
    shape.0.iter().try_fold(1u64, |n, d| match d {
        Dim::Fixed(k) => n.checked_mul(*k),
        _ => Some(n),
    })
}

fn product(dims: &[u64]) -> Option<u64> {
    dims.iter().try_fold(1u64, |n, &d| n.checked_mul(d))
}

/// Checks one rank's program and manifest; returns the collectives it issues, in order.
fn check_rank<'a>(
    plan: &Plan,
    rank: usize,
    program: &'a RankProgram,
    limit: u64,
    found: &mut Found,
) -> Vec<Issue<'a>> {
    let instrs = &program.instrs;
    // Where each id is first defined; sized by the program, never by an id's value.
    let mut first: HashMap<u32, usize> = HashMap::with_capacity(instrs.len());
    for (index, i) in instrs.iter().enumerate() {
        if u64::from(i.id) >= limit {
            found.say(instr_place(rank, i), Problem::IdBeyond { id: i.id, limit });
        }
        match first.entry(i.id) {
            Entry::Occupied(e) => found.say(
                instr_place(rank, i),
                Problem::DuplicateId {
                    id: i.id,
                    first: *e.get(),
                },
            ),
            Entry::Vacant(v) => {
                v.insert(index);
            }
        }
    }
    let weights = check_manifest(rank, program, found);
    let mut used: HashSet<&str> = HashSet::new();
    let mut outputs = 0usize;
    let mut issued = Vec::new();
    for (index, i) in instrs.iter().enumerate() {
        let place = || instr_place(rank, i);
        let arity_ok = i.inputs.len() == i.op.arity();
        if !arity_ok {
            found.say(
                place(),
                Problem::Arity {
                    kind: i.op.kind(),
                    expected: i.op.arity(),
                    found: i.inputs.len(),
                },
            );
        }
        let mut inputs: SmallVec<[&Instr; 4]> = SmallVec::new();
        for (slot, &input) in i.inputs.iter().enumerate() {
            match first.get(&input) {
                None => found.say(place(), Problem::UndefinedInput { slot, input }),
                Some(&at) if at >= index => found.say(
                    place(),
                    Problem::UseBeforeDef {
                        slot,
                        input,
                        defined_at: at,
                        index,
                    },
                ),
                Some(&at) => inputs.push(&instrs[at]),
            }
        }
        let inputs_ok = arity_ok && inputs.len() == i.inputs.len();
        if elements(&i.fact.shape).is_none() {
            found.say(
                place(),
                Problem::Overflow {
                    what: format!("the element count of its fact {}", i.fact),
                },
            );
        }
        match &i.op {
            Op::Output(_) => outputs += 1,
            Op::Param(p) => {
                used.insert(&p.tensor);
                check_param_weight(plan, place, p, weights.get(&*p.tensor).copied(), found);
            }
            _ => {}
        }
        if inputs_ok {
            let facts: SmallVec<[&TensorFact; 4]> = inputs.iter().map(|x| &x.fact).collect();
            match local_fact(plan, &i.op, &facts) {
                Ok(f) if f != i.fact => found.say(
                    place(),
                    Problem::Fact {
                        recorded: Box::new(i.fact.clone()),
                        inferred: Box::new(f),
                    },
                ),
                Ok(_) => {}
                Err(problem) => found.say(place(), problem),
            }
            if let (Op::Embedding(e), Some(table)) = (&i.op, inputs.get(1)) {
                check_vocab_range(e.vocab_range, table, &weights, place, found);
            }
        }
        if i.op.is_collective() {
            // Issued even when its input is broken, so that positions stay aligned.
            let elements = if inputs_ok {
                inputs.first().and_then(|x| elements(&x.fact.shape))
            } else {
                None
            };
            issued.push(Issue {
                issued: Issued {
                    id: i.id,
                    kind: i.op.kind(),
                    elements,
                },
                instr: i,
            });
        }
    }
    if outputs != 1 {
        found.say(
            Place::Rank { rank },
            Problem::OutputCount { found: outputs },
        );
    }
    for (id, problem) in super::fuse_norm::groups(program).1 {
        let name = program
            .instrs
            .iter()
            .find(|i| i.id == id)
            .map(|i| i.name.clone())
            .unwrap_or_default();
        found.say(
            Place::Instr { rank, id, name },
            Problem::ReduceNorm(problem),
        );
    }
    for (index, problem) in super::fuse::problems(program) {
        found.say(Place::Rank { rank }, Problem::Fused { index, problem });
    }
    for w in &program.weights {
        if !used.contains(&*w.tensor) {
            found.say(
                Place::Weight {
                    rank,
                    tensor: w.tensor.clone(),
                },
                Problem::UnusedWeight,
            );
        }
    }
    issued
}

/// The rank's manifest by tensor (first entry of each), after checking every entry on
/// its own: duplicates, ranges inside the checkpoint tensor, shapes, what the loader can slice.
fn check_manifest<'a>(
    rank: usize,
    program: &'a RankProgram,
    found: &mut Found,
) -> HashMap<&'a str, &'a WeightSlice> {
    let mut by_tensor: HashMap<&str, (usize, &WeightSlice)> =
        HashMap::with_capacity(program.weights.len());
    for (index, w) in program.weights.iter().enumerate() {
        let place = || Place::Weight {
            rank,
            tensor: w.tensor.clone(),
        };
        match by_tensor.entry(&w.tensor) {
            Entry::Occupied(e) => found.say(place(), Problem::DuplicateWeight { first: e.get().0 }),
            Entry::Vacant(v) => {
                v.insert((index, w));
            }
        }
        for problem in slice_problems(w) {
            found.say(place(), problem);
        }
    }
    by_tensor.into_iter().map(|(t, (_, w))| (t, w)).collect()
}

/// What is wrong with one weight entry on its own.
fn slice_problems(w: &WeightSlice) -> Vec<Problem> {
    let mut out = Vec::new();
    let rank = w.shape.len();
    for (what, dims) in [
        ("checkpoint shape", &w.shape),
        ("local_shape", &w.local_shape),
    ] {
        let bytes = product(dims).and_then(|n| n.checked_mul(w.dtype.size_bytes()));
        if bytes.is_none() {
            out.push(Problem::Overflow {
                what: format!("the byte size of its {what} {dims:?}"),
            });
        }
    }
    if w.local_shape.len() != rank {
        out.push(Problem::LocalRank {
            shape: w.shape.clone(),
            local: w.local_shape.clone(),
        });
        return out;
    }
    let Some(dim) = w.dim else {
        if w.local_shape != w.shape || !w.ranges.is_empty() || w.padding != 0 {
            out.push(Problem::WholeMismatch {
                shape: w.shape.clone(),
                local: w.local_shape.clone(),
                ranges: w.ranges.len(),
                padding: w.padding,
            });
        }
        return out;
    };
    let d = dim as usize;
    if d >= rank {
        out.push(Problem::SplitDimOutside { dim, rank });
        return out;
    }
    // `load_slice` reads row blocks (dim 0) or column blocks of a matrix (dim 1); a stack
    // of experts is read as each expert's matrix, so one dim further.
    let stacked = crate::plan::experts::is_stacked(&w.tensor) && rank == 3;
    if !(d == 0 || (d == 1 && rank == 2) || (stacked && d <= 2)) {
        out.push(Problem::LoaderCannotSlice { dim, rank });
    }
    let size = w.shape[d];
    for (index, r) in w.ranges.iter().enumerate() {
        if r.offset.checked_add(r.len).is_none_or(|end| end > size) {
            out.push(Problem::RangeOutside {
                index,
                offset: r.offset,
                len: r.len,
                dim,
                size,
            });
        }
    }
    let covered = w
        .ranges
        .iter()
        .try_fold(w.padding, |n, r| n.checked_add(r.len)?.checked_add(r.pad));
    if covered != Some(w.local_shape[d]) {
        out.push(Problem::RangeTotal {
            dim,
            covered,
            local: w.local_shape[d],
        });
    }
    let others_differ = (0..rank).any(|k| k != d && w.local_shape[k] != w.shape[k]);
    if others_differ {
        out.push(Problem::OtherDims {
            dim,
            shape: w.shape.clone(),
            local: w.local_shape.clone(),
        });
    }
    out
}

/// Whether two ranks' instructions of one id run the same op: equal but for what
/// partition sets per rank (a param's local shape, an embedding's rows).
fn same_op(a: &Instr, b: &Instr) -> bool {
    let ops = match (&a.op, &b.op) {
        (Op::Param(x), Op::Param(y)) => x.tensor == y.tensor && x.dtype == y.dtype,
        (Op::Embedding(_), Op::Embedding(_)) => true,
        (x, y) => x == y,
    };
    ops && a.name == b.name
}

fn describe(i: &Instr) -> String {
    format!("{} `{}` {{{}}}", i.op.kind(), i.name, i.op.attrs())
}

/// Ranks share value ids: an id names one op of the model, which every rank holding it
/// runs on its own piece (a rank may lack ids that only rank 0 computes).
fn check_same_ops(plan: &Plan, found: &mut Found) {
    let Some(base) = plan.ranks.first() else {
        return;
    };
    let by_id: HashMap<u32, &Instr> = base.instrs.iter().rev().map(|i| (i.id, i)).collect();
    for (rank, program) in plan.ranks.iter().enumerate().skip(1) {
        for i in &program.instrs {
            let Some(theirs) = by_id.get(&i.id) else {
                continue;
            };
            if !same_op(i, theirs) {
                found.say(
                    instr_place(rank, i),
                    Problem::OpDiffers {
                        other: 0,
                        ours: describe(i),
                        theirs: describe(theirs),
                    },
                );
            }
        }
    }
}

fn weight_key(w: &WeightSlice) -> WeightKey {
    WeightKey {
        shape: w.shape.clone(),
        dtype: w.dtype,
        dim: w.dim,
    }
}

/// Every rank that holds a checkpoint tensor must read it the same way (shape, dtype,
/// split dim), and a split tensor's ranges on all ranks together must cover its split dim:
/// the checkpoint is checked against one rank's entry only, and a piece no rank loads is
/// a part of the model that never runs.
fn check_tensors(plan: &Plan, found: &mut Found) {
    struct Held<'a> {
        first_rank: usize,
        first: &'a WeightSlice,
        agree: bool,
        ranges: Vec<SliceRange>,
    }
    let mut index: HashMap<&str, usize> = HashMap::new();
    let mut held: Vec<Held> = Vec::new();
    for (rank, program) in plan.ranks.iter().enumerate() {
        for w in &program.weights {
            let Some(&k) = index.get(&*w.tensor) else {
                index.insert(&w.tensor, held.len());
                held.push(Held {
                    first_rank: rank,
                    first: w,
                    agree: true,
                    ranges: w.ranges.clone(),
                });
                continue;
            };
            let h = &mut held[k];
            if weight_key(w) == weight_key(h.first) {
                h.ranges.extend_from_slice(&w.ranges);
            } else {
                h.agree = false;
                found.say(
                    Place::Weight {
                        rank,
                        tensor: w.tensor.clone(),
                    },
                    Problem::WeightDisagrees {
                        other: h.first_rank,
                        ours: weight_key(w),
                        theirs: weight_key(h.first),
                    },
                );
            }
        }
    }
    for mut h in held.into_iter().filter(|h| h.agree) {
        let Some(dim) = h.first.dim else { continue };
        let Some(&size) = h.first.shape.get(dim as usize) else {
            continue; // reported on the entry
        };
        let ends: Option<Vec<u64>> = h
            .ranges
            .iter()
            .map(|r| r.offset.checked_add(r.len))
            .collect();
        if ends.is_none_or(|e| e.iter().any(|&end| end > size)) {
            continue; // reported on the entry
        }
        h.ranges.sort_unstable_by_key(|r| r.offset);
        let mut covered = 0u64;
        let mut gap = None;
        for r in &h.ranges {
            if r.offset > covered {
                gap = Some((covered, r.offset));
                break;
            }
            covered = covered.max(r.offset + r.len);
        }
        if let Some((start, end)) = gap.or((covered < size).then_some((covered, size))) {
            found.say(
                Place::Tensor {
                    tensor: h.first.tensor.clone(),
                },
                Problem::WeightCoverage {
                    dim,
                    size,
                    start,
                    end,
                },
            );
        }
    }
}

/// A param must match its one manifest entry: local shape and dtype.
fn check_param_weight(
    plan: &Plan,
    place: impl Fn() -> Place,
    p: &crate::ir::ParamOp,
    entry: Option<&WeightSlice>,
    found: &mut Found,
) {
    let Some(w) = entry else {
        found.say(
            place(),
            Problem::MissingWeight {
                tensor: p.tensor.clone(),
            },
        );
        return;
    };
    if w.local_shape != p.shape {
        found.say(
            place(),
            Problem::WeightShape {
                param: p.shape.clone(),
                manifest: w.local_shape.clone(),
            },
        );
    }
    let dtype = p.dtype.unwrap_or(plan.dtype);
    if w.dtype != dtype {
        found.say(
            place(),
            Problem::WeightDtype {
                param: dtype,
                manifest: w.dtype,
            },
        );
    }
}

/// The fact an instruction must have on this rank, given its inputs' recorded facts.
/// Collectives and local slices change the split dim by tp; the rest is the graph's own
/// shape inference, which is shape-generic and so holds for local shapes too.
fn local_fact(plan: &Plan, op: &Op, inputs: &[&TensorFact]) -> Result<TensorFact, Problem> {
    let tp = plan.tp;
    let uneven = op
        .cut()
        .filter(|c| !c.pieces.is_empty() && !inputs[0].shape.is_sequence(c.dim));
    if let Some(cut) = uneven {
        return uneven_cut_fact(tp, op.kind(), cut, inputs);
    }
    match op {
        // Sequence parallelism: the sequence dim stays symbolic (a rank's block of a
        // call's tokens is decided at run time).
        Op::AllGather(AllGatherOp {
            dim,
            unpad_to: None,
            ..
        })
        | Op::ReduceScatter(ReduceScatterOp { dim, .. })
        | Op::LocalSlice(LocalSliceOp { dim, .. })
            if inputs[0].shape.is_sequence(*dim) =>
        {
            Ok(inputs[0].clone())
        }
        Op::AllGather(g) => {
            let x = inputs[0];
            let n = moved_dim(op.kind(), g.dim, x)?;
            let gathered = n.checked_mul(tp).ok_or_else(|| Problem::Overflow {
                what: format!("dim {} of {x} times tp={tp}", g.dim),
            })?;
            let size = match g.unpad_to {
                Some(unpad_to) if unpad_to > gathered => {
                    return Err(Problem::UnpadTooLarge { unpad_to, gathered })
                }
                Some(unpad_to) => unpad_to,
                None => gathered,
            };
            let counted = g.pieces.iter().try_fold(0u64, |t, &p| t.checked_add(p));
            let fits = g.pieces.len() as u64 == tp
                && g.pieces.iter().all(|&p| p <= n)
                && counted == Some(size);
            if !g.pieces.is_empty() && !fits {
                return Err(Problem::BadPieces {
                    pieces: g.pieces.clone(),
                    tp,
                    local: n,
                    size,
                });
            }
            Ok(with_dim(x, g.dim, size))
        }
        Op::ReduceScatter(ReduceScatterOp { dim, .. })
        | Op::LocalSlice(LocalSliceOp { dim, .. }) => {
            let x = inputs[0];
            let n = moved_dim(op.kind(), *dim, x)?;
            if tp == 0 || n % tp != 0 {
                return Err(Problem::NotDivisible {
                    kind: op.kind(),
                    dim: *dim,
                    size: n,
                    tp,
                });
            }
            Ok(with_dim(x, *dim, n / tp))
        }
        Op::Unfuse(u) if u.groups.checked_len().is_none() => Err(Problem::Overflow {
            what: "the length of its unfuse structure".into(),
        }),
        _ => {
            crate::frontend::validate::check_op(op)
                .map_err(|message| Problem::Attribute { message })?;
            infer(op, inputs, plan.dtype).map_err(|message| Problem::Inference { message })
        }
    }
}

/// The fact of a local slice or reduce-scatter of uneven pieces: each rank holds the
/// largest piece; the pieces one after another cover the dim once, or, placed by their
/// starts (replicated heads), each lies inside it.
fn uneven_cut_fact(
    tp: u64,
    kind: &'static str,
    Cut {
        dim,
        pieces,
        starts,
    }: Cut<'_>,
    inputs: &[&TensorFact],
) -> Result<TensorFact, Problem> {
    let x = inputs[0];
    let n = moved_dim(kind, dim, x)?;
    let counted = pieces.iter().try_fold(0u64, |t, &p| t.checked_add(p));
    let local = pieces.iter().copied().max().unwrap_or(0);
    // Pieces one after another cover the dim once; placed by `starts` (replicated
    // heads), each lies inside it.
    let fits = match starts.is_empty() {
        true => counted == Some(n),
        false => {
            starts.len() == pieces.len()
                && starts
                    .iter()
                    .zip(pieces)
                    .all(|(&s, &p)| s.checked_add(p).is_some_and(|end| end <= n))
        }
    };
    if pieces.len() as u64 != tp || !fits {
        return Err(Problem::BadPieces {
            pieces: pieces.to_vec(),
            tp,
            local,
            size: n,
        });
    }
    Ok(with_dim(x, dim, local))
}

/// The size of the dim a collective moves: fixed, and the last one (the runtime treats
/// every value as rows × features).
fn moved_dim(kind: &'static str, dim: u32, x: &TensorFact) -> Result<u64, Problem> {
    let n = x
        .shape
        .fixed_at(dim as usize)
        .ok_or_else(|| Problem::CollectiveDim {
            kind,
            dim,
            input: Box::new(x.clone()),
        })?;
    if dim as usize + 1 != x.shape.rank() {
        return Err(Problem::CollectiveNotLast {
            kind,
            dim,
            rank: x.shape.rank(),
        });
    }
    Ok(n)
}

fn with_dim(x: &TensorFact, dim: u32, n: u64) -> TensorFact {
    let mut f = x.clone();
    if let Some(d) = f.shape.0.get_mut(dim as usize) {
        *d = Dim::Fixed(n);
    }
    f
}

/// An embedding's `vocab_range` must lie in its table and say what the table's weight
/// entry loads: the rows `[offset, offset + len)` of the checkpoint, when split by rows.
fn check_vocab_range(
    range: Option<(u64, u64)>,
    table: &Instr,
    weights: &HashMap<&str, &WeightSlice>,
    place: impl Fn() -> Place,
    found: &mut Found,
) {
    let entry = match &table.op {
        Op::Param(p) => weights.get(&*p.tensor).copied(),
        _ => None,
    };
    if let (Some((offset, len)), Some(local_rows)) = (range, table.fact.shape.fixed_at(0)) {
        let checkpoint_rows = entry.and_then(|w| w.shape.first().copied());
        let end = offset.checked_add(len);
        let outside = len > local_rows
            || end.is_none()
            || checkpoint_rows.is_some_and(|rows| end.is_some_and(|e| e > rows));
        if outside {
            found.say(
                place(),
                Problem::VocabRangeOutside {
                    offset,
                    len,
                    local_rows,
                    checkpoint_rows,
                },
            );
        }
    }
    let Some(w) = entry else { return };
    let expected = match w.dim {
        Some(0) => {
            let start = w.ranges.first().map_or(0, |r| r.offset);
            let Some(len) = w.ranges.iter().try_fold(0u64, |n, r| n.checked_add(r.len)) else {
                return; // reported on the weight entry
            };
            Some((start, len))
        }
        _ => None,
    };
    if range != expected {
        found.say(
            place(),
            Problem::VocabRange {
                found: range,
                expected,
            },
        );
    }
}

/// Whether two ranks' collectives at one position agree (an unknown size matches any).
fn same(a: Option<&Issue>, b: Option<&Issue>) -> bool {
    match (a, b) {
        (Some(a), Some(b)) => {
            let (a, b) = (a.issued, b.issued);
            a.id == b.id
                && a.kind == b.kind
                && (a.elements.is_none() || b.elements.is_none() || a.elements == b.elements)
        }
        (None, None) => true,
        _ => false,
    }
}

/// Every rank must issue rank 0's collectives in rank 0's order: the communicator pairs
/// them by position, so any difference deadlocks or mixes up values.
fn check_collective_order(issued: &[Vec<Issue>], found: &mut Found) {
    let Some(base) = issued.first() else { return };
    for (rank, seq) in issued.iter().enumerate().skip(1) {
        let n = base.len().max(seq.len());
        if let Some(position) = (0..n).find(|&k| !same(seq.get(k), base.get(k))) {
            found.say(
                Place::Rank { rank },
                Problem::CollectiveOrder {
                    position,
                    other: 0,
                    ours: seq.get(position).map(|i| i.issued),
                    theirs: base.get(position).map(|i| i.issued),
                },
            );
        }
    }
}

/// `plan.collectives` must list rank 0's collectives, with sizes the facts give.
fn check_collective_list(plan: &Plan, base: &[Issue], found: &mut Found) {
    let n = plan.collectives.len().max(base.len());
    for k in 0..n {
        match (plan.collectives.get(k), base.get(k)) {
            (Some(c), Some(i)) if c.id == i.issued.id && c.kind == i.issued.kind => {
                let place = || Place::Collective {
                    index: k,
                    id: c.id,
                    name: c.name.clone(),
                };
                if c.name != *i.instr.name {
                    found.say(
                        place(),
                        Problem::CollectiveName {
                            id: c.id,
                            listed: c.name.clone(),
                            actual: i.instr.name.to_string(),
                        },
                    );
                }
                for (field, listed, expected) in listed_sizes(plan.tp, c, i) {
                    if Some(listed) != expected {
                        found.say(
                            place(),
                            Problem::CollectiveSize {
                                field,
                                listed,
                                expected,
                            },
                        );
                    }
                }
            }
            (Some(c), actual) => found.say(
                Place::Collective {
                    index: k,
                    id: c.id,
                    name: c.name.clone(),
                },
                Problem::CollectiveListed {
                    id: c.id,
                    kind: c.kind.clone(),
                    actual: actual.map(|i| i.issued),
                },
            ),
            (None, Some(i)) => found.say(
                Place::Plan,
                Problem::CollectiveUnlisted {
                    position: k,
                    issued: i.issued,
                },
            ),
            (None, None) => {}
        }
    }
}

/// Each size field of a listed collective with the value its instruction's facts give:
/// the whole moved value (an all-gather's gathered value, padding included).
fn listed_sizes(
    tp: u64,
    c: &super::Collective,
    i: &Issue,
) -> [(&'static str, u64, Option<u64>); 3] {
    // Over the sequence, each token's row moves whole.
    let all_gather =
        matches!(&i.instr.op, Op::AllGather(g) if !i.instr.fact.shape.is_sequence(g.dim));
    let elements = if all_gather {
        i.issued.elements.and_then(|e| e.checked_mul(tp))
    } else {
        i.issued.elements
    };
    let bytes = elements.and_then(|e| e.checked_mul(i.instr.fact.dtype.size_bytes()));
    let steps = super::Collective::ring_passes(&i.instr.op);
    let ring = match (bytes, tp) {
        (Some(b), 1..) => Some((b as f64 * (steps * (tp - 1) as f64 / tp as f64)).round() as u64),
        _ => None,
    };
    [
        ("elements_per_token", c.elements_per_token, elements),
        ("bytes_per_token", c.bytes_per_token, bytes),
        (
            "ring_wire_bytes_per_token",
            c.ring_wire_bytes_per_token,
            ring,
        ),
    ]
}

mod numerics;
#[cfg(test)]
mod tests;
