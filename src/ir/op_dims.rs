//! One declarative table of how each op's dimensions relate across tp ranks.
//!
//! Every op is described einsum-like: each operand is a list of dims named by letters
//! (`x[.., k] · w[n, k] → y[.., n]`), and each letter has a [`Role`] that says what a split
//! of it means (kept on the output, summed into partial sums, or impossible). Beside the
//! dims the table says which inputs the op is linear in (so a partial sum may flow
//! through), and three execution facts: whether the op may overwrite its first input,
//! whether it is row-wise, whether it is a collective.
//!
//! The sharding rules (`passes::rules`), the partial-sum check (`passes::partial_check`),
//! the partitioner's rank-0-only terms (`plan::partition`) and the executor read these
//! facts from here instead of restating them; policy (which of the admitted layouts to
//! prefer) stays with the rules.

use super::layout::Layout;
use super::op::*;
use std::fmt;

/// Activations are `[B, S, features..]`: the first two dims are tokens, which tp never
/// splits.
pub const TOKEN_DIMS: u32 = 2;

/// What one dim letter does inside an op.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// Carried to the output. Split on every operand that has it, the output is split
    /// there too; operands without it are broadcast over it and must be whole.
    Kept,
    /// Summed over (the `k` of `x · W`). Split on every operand that has it, each rank
    /// holds a partial sum of the whole output.
    Contracted,
    /// Indexed by a lookup (an embedding's vocabulary). Split on the table, each rank looks
    /// up the ids its rows hold and yields zeros for the others, so the output is partial
    /// sums; the ids do not have this letter.
    Lookup,
    /// Mixed non-linearly inside the op (a norm's statistics, the pairs RoPE rotates, a
    /// head's dot product): every operand must hold it whole.
    Mixed,
}

impl Role {
    /// Whether a split of a letter with this role is something the op can run on.
    pub fn splittable(self) -> bool {
        !matches!(self, Role::Mixed)
    }
}

/// One operand (an input or the output), as einsum-like dims.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Operand {
    /// Starts with `..`: leading dims (the tokens of an activation; for a model output or a
    /// collective, all its dims) that every operand with `..` shares one-to-one and that
    /// this op never splits.
    pub ellipsis: bool,
    /// The dims after `..`, outermost first. A dim is one or more letters, outermost
    /// first: `"hd"` is one dim of `h` heads of `d` features each. A split of a dim splits
    /// its first letter (whole heads).
    pub dims: &'static [&'static str],
}

impl Operand {
    /// How many `..` dims a tensor of `rank` has here, or `None` if the rank does not fit.
    fn lead(&self, rank: usize) -> Option<usize> {
        if self.ellipsis {
            rank.checked_sub(self.dims.len())
        } else {
            (rank == self.dims.len()).then_some(0)
        }
    }

    /// The letter a split of `dim` splits, for a tensor of `rank`; `None` for a `..` dim
    /// or a dim outside the tensor.
    pub fn letter_at(&self, dim: u32, rank: usize) -> Option<char> {
        let axis = (dim as usize).checked_sub(self.lead(rank)?)?;
        self.dims.get(axis)?.chars().next()
    }

    /// The dim whose first letter is `letter`, for a tensor of `rank`.
    pub fn dim_of(&self, letter: char, rank: usize) -> Option<u32> {
        let axis = self.dims.iter().position(|d| d.starts_with(letter))?;
        u32::try_from(self.lead(rank)?.checked_add(axis)?).ok()
    }

    /// Whether any dim has `letter`.
    pub fn has(&self, letter: char) -> bool {
        self.dims.iter().any(|d| d.contains(letter))
    }
}

impl fmt::Display for Operand {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts: Vec<String> = Vec::new();
        if self.ellipsis {
            parts.push("..".into());
        }
        for d in self.dims {
            parts.push(if d.chars().count() > 1 {
                format!(
                    "({})",
                    d.chars().map(String::from).collect::<Vec<_>>().join(" ")
                )
            } else {
                (*d).to_string()
            });
        }
        write!(f, "[{}]", parts.join(", "))
    }
}

/// Which inputs a partial sum may flow into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Linearity {
    /// None: a partial sum is reduced before the op.
    None,
    /// The output is the sum of the inputs (broadcast where shapes differ). A partial sum
    /// may flow through the listed slots, alone or together; a whole addend beside a
    /// partial one must be added on one rank only.
    Sum(&'static [u32]),
    /// Linear in each listed slot while every other input is whole (`x · W`, `a ⊙ b`, a
    /// slice, a sum over ranks): one partial input at a time.
    Each(&'static [u32]),
}

/// How one op's dims relate across ranks; see the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpDims {
    /// One operand per input slot, in slot order.
    pub inputs: &'static [Operand],
    /// The output. A weight's own dims are named by the ops that read it, so a param's
    /// output has none.
    pub output: Operand,
    /// The role of every letter the operands use.
    pub letters: &'static [(char, Role)],
    pub linear: Linearity,
    /// For an op that only moves a value between layouts (a collective, a local slice):
    /// the layout it takes and the one it gives. Such an op is judged by this alone.
    pub moves: Option<(Layout, Layout)>,
    /// Communicates between ranks.
    pub collective: bool,
    /// The output has input 0's shape and dtype and the kernel computes it in input 0's
    /// buffer (elementwise, or row-local like RoPE's pair rotation): the executor may hand
    /// the op input 0 to overwrite.
    pub in_place: bool,
    /// Each output row (token) depends only on the same row of input 0, every other input
    /// being a weight: selecting rows before the op equals selecting them after.
    pub row_wise: bool,
}

const fn act(dims: &'static [&'static str]) -> Operand {
    Operand {
        ellipsis: true,
        dims,
    }
}

const fn weight(dims: &'static [&'static str]) -> Operand {
    Operand {
        ellipsis: false,
        dims,
    }
}

/// `[..]`: tokens (ids, positions) or a value taken as a whole.
const WHOLE: Operand = act(&[]);
/// `[.., h]`: an activation with one feature dim.
const FEAT: Operand = act(&["h"]);
/// `[h]`: a per-feature weight.
const VEC: Operand = weight(&["h"]);
/// `[.., (h d)]`: heads of `d` features.
const HEADS: Operand = act(&["hd"]);
/// `[.., (g e)]`: groups of `e` features (per-head norm).
const GROUPS: Operand = act(&["ge"]);
/// `[e]`: a per-group-element weight.
const VEC_E: Operand = weight(&["e"]);

const X_K: Operand = act(&["k"]);
const Y_N: Operand = act(&["n"]);
const W_NK: Operand = weight(&["n", "k"]);
const W_KN: Operand = weight(&["k", "n"]);
const TABLE: Operand = weight(&["v", "h"]);
/// `[.., e]`: one value per expert (router logits, routing weights).
const PER_EXPERT: Operand = act(&["e"]);
/// `[e, f, h]`: each expert's gate or up projection.
const EXPERT_IN: Operand = weight(&["e", "f", "h"]);
/// `[e, h, f]`: each expert's down projection.
const EXPERT_OUT: Operand = weight(&["e", "h", "f"]);
/// A param's output: its dims are named where it is read.
const PARAM: Operand = weight(&[]);

use Role::*;

/// The description of `op`. Attributes matter where they change the dims (a linear's
/// weight order, a grouped norm, a collective's dim).
pub fn dims(op: &Op) -> OpDims {
    let split = |dim: u32| Layout::Split { dim };
    let feature = |dim: u32| dim >= TOKEN_DIMS;
    match op {
        Op::Input(_) => OpDims {
            inputs: &[],
            output: WHOLE,
            letters: &[],
            linear: Linearity::None,
            moves: None,
            collective: false,
            in_place: false,
            row_wise: false,
        },
        Op::Param(_) => OpDims {
            inputs: &[],
            output: PARAM,
            letters: &[],
            linear: Linearity::None,
            moves: None,
            collective: false,
            in_place: false,
            row_wise: false,
        },
        // ids[..] · table[v, h] → [.., h]. Linear in the table in exact terms, but a table is
        // a weight and never a partial sum.
        Op::Embedding(_) => OpDims {
            inputs: &[WHOLE, TABLE],
            output: FEAT,
            letters: &[('v', Lookup), ('h', Kept)],
            linear: Linearity::None,
            moves: None,
            collective: false,
            in_place: false,
            row_wise: true,
        },
        // x[.., k] · w[n, k] → [.., n] (or w[k, n] for a Conv1D weight).
        Op::Linear(l) => OpDims {
            inputs: match l.weight_order {
                WeightOrder::OutIn => &[X_K, W_NK],
                WeightOrder::InOut => &[X_K, W_KN],
            },
            output: Y_N,
            letters: &[('k', Contracted), ('n', Kept)],
            linear: Linearity::Each(&[0]),
            moves: None,
            collective: false,
            in_place: false,
            row_wise: true,
        },
        // x[.., h] + b[h]; the bias is a whole addend.
        Op::BiasAdd(_) => OpDims {
            inputs: &[FEAT, VEC],
            output: FEAT,
            letters: &[('h', Kept)],
            linear: Linearity::Sum(&[0]),
            moves: None,
            collective: false,
            in_place: true,
            row_wise: true,
        },
        Op::Add(_) => OpDims {
            inputs: &[FEAT, FEAT],
            output: FEAT,
            letters: &[('h', Kept)],
            linear: Linearity::Sum(&[0, 1]),
            moves: None,
            collective: false,
            in_place: true,
            row_wise: false,
        },
        Op::Mul(_) => OpDims {
            inputs: &[FEAT, FEAT],
            output: FEAT,
            letters: &[('h', Kept)],
            linear: Linearity::Each(&[0, 1]),
            moves: None,
            collective: false,
            in_place: true,
            row_wise: false,
        },
        // x[.., h] ⊙ σ(g), one gate value per token (`[.., 1]`, taken whole): a partial x
        // scales by the whole gate.
        Op::SigmoidGate(_) => OpDims {
            inputs: &[FEAT, WHOLE],
            output: FEAT,
            letters: &[('h', Kept)],
            linear: Linearity::Each(&[0]),
            moves: None,
            collective: false,
            in_place: false,
            row_wise: false,
        },
        Op::Activation(_) => OpDims {
            inputs: &[FEAT],
            output: FEAT,
            letters: &[('h', Kept)],
            linear: Linearity::None,
            moves: None,
            collective: false,
            in_place: true,
            row_wise: true,
        },
        // The statistics run over the whole feature dim, or over each group of it.
        Op::RmsNorm(n) => OpDims {
            inputs: match n.group {
                Some(_) => &[GROUPS, VEC_E],
                None => &[FEAT, VEC],
            },
            output: match n.group {
                Some(_) => GROUPS,
                None => FEAT,
            },
            letters: match n.group {
                Some(_) => &[('g', Kept), ('e', Mixed)],
                None => &[('h', Mixed)],
            },
            linear: Linearity::None,
            moves: None,
            // Fused with the all-reduce of its input (set only after sharding).
            collective: n.reduce_input.is_some(),
            in_place: false,
            row_wise: true,
        },
        Op::LayerNorm(_) => OpDims {
            inputs: &[FEAT, VEC, VEC],
            output: FEAT,
            letters: &[('h', Mixed)],
            linear: Linearity::None,
            moves: None,
            collective: false,
            in_place: false,
            row_wise: true,
        },
        // Rotates pairs within each head by the token's position. Linear in x in exact
        // terms, but partial sums are reduced first (the rule never lets them in).
        Op::Rope(_) => OpDims {
            inputs: &[HEADS, WHOLE],
            output: HEADS,
            letters: &[('h', Kept), ('d', Mixed)],
            linear: Linearity::None,
            moves: None,
            collective: false,
            in_place: true,
            row_wise: false,
        },
        // q, k, v [.., (h d)] → [.., (h d)]: each head on its own. k and v may hold fewer
        // (grouped) heads; a rank's query heads read its own kv heads, which are replicated
        // where tp exceeds their count. Mixes over the tokens (causal), which tp never
        // splits. Linear in v in exact terms, but partial sums are reduced first.
        Op::Attention(_) => OpDims {
            inputs: &[HEADS, HEADS, HEADS],
            output: HEADS,
            letters: &[('h', Kept), ('d', Mixed)],
            linear: Linearity::None,
            moves: None,
            collective: false,
            in_place: false,
            row_wise: false,
        },
        // Keeps one part of a fused feature dim; a split by the fused structure splits
        // every part, so the kept part stays split.
        Op::Unfuse(_) => OpDims {
            inputs: &[FEAT],
            output: FEAT,
            letters: &[('h', Kept)],
            linear: Linearity::Each(&[0]),
            moves: None,
            collective: false,
            in_place: false,
            row_wise: true,
        },
        // A model output leaves the program whole.
        Op::Output(_) => OpDims {
            inputs: &[WHOLE],
            output: WHOLE,
            letters: &[],
            linear: Linearity::None,
            moves: None,
            collective: false,
            in_place: false,
            row_wise: true,
        },
        Op::AllReduce(_) => OpDims {
            inputs: &[WHOLE],
            output: WHOLE,
            letters: &[],
            linear: Linearity::Each(&[0]),
            moves: Some((Layout::Partial, Layout::Replicated)),
            collective: true,
            in_place: true,
            row_wise: true,
        },
        Op::AllGather(g) => OpDims {
            inputs: &[WHOLE],
            output: WHOLE,
            letters: &[],
            linear: Linearity::None,
            moves: Some((split(g.dim), Layout::Replicated)),
            collective: true,
            in_place: false,
            row_wise: feature(g.dim),
        },
        Op::ReduceScatter(r) => OpDims {
            inputs: &[WHOLE],
            output: WHOLE,
            letters: &[],
            linear: Linearity::Each(&[0]),
            moves: Some((Layout::Partial, split(r.dim))),
            collective: true,
            in_place: false,
            row_wise: feature(r.dim),
        },
        Op::LocalSlice(s) => OpDims {
            inputs: &[WHOLE],
            output: WHOLE,
            letters: &[],
            linear: Linearity::None,
            moves: Some((Layout::Replicated, split(s.dim))),
            collective: false,
            in_place: false,
            row_wise: feature(s.dim),
        },
        // Softmax and top-k over all experts: the logits must be whole.
        Op::Route(_) => OpDims {
            inputs: &[PER_EXPERT],
            output: PER_EXPERT,
            letters: &[('e', Mixed)],
            linear: Linearity::None,
            moves: None,
            collective: false,
            in_place: false,
            row_wise: true,
        },
        // Σ_e routing[e] · down_e(act(gate_e · x) ⊙ up_e · x): split by experts (each rank
        // sums its experts, reading its columns of the routing) or by each expert's
        // features (each rank sums its columns of every expert's product), the output is a
        // partial sum either way. x is read whole by every expert.
        Op::Experts(_) => OpDims {
            inputs: &[FEAT, PER_EXPERT, EXPERT_IN, EXPERT_IN, EXPERT_OUT],
            output: FEAT,
            letters: &[('h', Mixed), ('e', Contracted), ('f', Contracted)],
            linear: Linearity::None,
            moves: None,
            collective: false,
            in_place: false,
            row_wise: false,
        },
    }
}

impl OpDims {
    /// The role of `letter`.
    pub fn role(&self, letter: char) -> Option<Role> {
        self.letters
            .iter()
            .find(|(l, _)| *l == letter)
            .map(|&(_, r)| r)
    }

    /// The letter a split of `dim` on input `slot` splits, if the op can run that way;
    /// `ranks[i]` is input i's tensor rank.
    pub fn split_letter(&self, slot: usize, dim: u32, ranks: &[usize]) -> Option<char> {
        let letter = self.inputs.get(slot)?.letter_at(dim, *ranks.get(slot)?)?;
        self.role(letter).filter(|r| r.splittable()).map(|_| letter)
    }

    /// The dim of input `slot` whose first letter has `role`.
    pub fn input_dim_with(&self, slot: usize, role: Role, ranks: &[usize]) -> Option<u32> {
        let operand = self.inputs.get(slot)?;
        let rank = *ranks.get(slot)?;
        operand
            .dims
            .iter()
            .filter_map(|d| d.chars().next())
            .find(|&l| self.role(l) == Some(role))
            .and_then(|l| operand.dim_of(l, rank))
    }

    /// The number of `..` dims, read off the first input that has them.
    fn lead(&self, ranks: &[usize]) -> Option<usize> {
        self.inputs
            .iter()
            .zip(ranks)
            .find(|(o, _)| o.ellipsis)
            .and_then(|(o, &r)| o.lead(r))
    }

    /// The output dim whose first letter is `letter`.
    pub fn output_dim(&self, letter: char, ranks: &[usize]) -> Option<u32> {
        let lead = if self.output.ellipsis {
            self.lead(ranks)?
        } else {
            0
        };
        let rank = lead.checked_add(self.output.dims.len())?;
        self.output.dim_of(letter, rank)
    }

    /// The layouts that run the op with `letter` split: every operand that has it is split
    /// along it and the others are whole; the output is split along it (kept) or partial
    /// (contracted, looked up). `None` if the letter cannot be split.
    pub fn split_along(&self, letter: char, ranks: &[usize]) -> Option<(Vec<Layout>, Layout)> {
        let role = self.role(letter).filter(|r| r.splittable())?;
        let inputs = self
            .inputs
            .iter()
            .enumerate()
            .map(|(i, o)| {
                if o.has(letter) {
                    let dim = o.dim_of(letter, *ranks.get(i)?)?;
                    Some(Layout::Split { dim })
                } else {
                    Some(Layout::Replicated)
                }
            })
            .collect::<Option<Vec<_>>>()?;
        let output = match role {
            Kept => Layout::Split {
                dim: self.output_dim(letter, ranks)?,
            },
            _ => Layout::Partial,
        };
        Some((inputs, output))
    }

    /// The layouts that let the partial sums among `given` stay partial (every other input
    /// whole, the output partial), or `None` if the op is linear in none of them. A sum
    /// keeps every partial addend it is linear in; a product keeps the first partial factor.
    pub fn keep_partial(&self, given: &[Layout]) -> Option<(Vec<Layout>, Layout)> {
        let n = self.inputs.len();
        let partial = |i: usize| given.get(i) == Some(&Layout::Partial);
        let keep: Vec<bool> = match self.linear {
            Linearity::None => return None,
            Linearity::Sum(slots) => (0..n)
                .map(|i| partial(i) && slots.contains(&(i as u32)))
                .collect(),
            Linearity::Each(slots) => {
                let first = slots.iter().map(|&s| s as usize).find(|&s| partial(s))?;
                (0..n).map(|i| i == first).collect()
            }
        };
        if !keep.contains(&true) {
            return None;
        }
        let inputs = keep
            .iter()
            .map(|&k| {
                if k {
                    Layout::Partial
                } else {
                    Layout::Replicated
                }
            })
            .collect();
        Some((inputs, Layout::Partial))
    }

    /// Whether a partial sum may flow into input `slot` when the inputs have `layouts`.
    pub fn linear_in(&self, slot: u32, layouts: &[Layout]) -> bool {
        match self.linear {
            Linearity::None => false,
            Linearity::Sum(slots) => slots.contains(&slot),
            Linearity::Each(slots) => {
                slots.contains(&slot)
                    && (0..self.inputs.len())
                        .filter(|&i| i != slot as usize)
                        .all(|i| layouts.get(i) == Some(&Layout::Replicated))
            }
        }
    }

    /// When the op adds a whole term to one partial sum (inputs `inputs`, output
    /// `output`): the slot of that partial input. Only rank 0 adds the term, so the sum
    /// over ranks gains it once; the other ranks pass that input through.
    pub fn rank0_only(&self, inputs: &[Layout], output: Layout) -> Option<usize> {
        let Linearity::Sum(slots) = self.linear else {
            return None;
        };
        if output != Layout::Partial || inputs.len() != self.inputs.len() {
            return None;
        }
        let mut partial = inputs
            .iter()
            .enumerate()
            .filter(|(_, l)| **l == Layout::Partial);
        let (keep, _) = partial.next()?;
        let whole_rest = inputs
            .iter()
            .enumerate()
            .all(|(i, &l)| i == keep || l == Layout::Replicated);
        (partial.next().is_none() && whole_rest && slots.contains(&(keep as u32))).then_some(keep)
    }

    /// Whether running the op on tp ranks with inputs laid out as `inputs` and the output
    /// as `output` computes the op, judged from the dims alone (`ranks[i]` is input i's
    /// tensor rank); the error says what does not fit. Sources (inputs and weights) are
    /// judged where they are read.
    pub fn admits(&self, inputs: &[Layout], ranks: &[usize], output: Layout) -> Result<(), String> {
        if inputs.len() != self.inputs.len() || ranks.len() != self.inputs.len() {
            return Err(format!(
                "takes {} inputs, got {} layouts and {} ranks",
                self.inputs.len(),
                inputs.len(),
                ranks.len()
            ));
        }
        if let Some((from, to)) = self.moves {
            return if inputs == [from] && output == to {
                Ok(())
            } else {
                Err(format!(
                    "turns {from} into {to}, not {} into {output}",
                    show(inputs)
                ))
            };
        }
        if self.inputs.is_empty() {
            return Ok(());
        }
        let mut letters: Vec<char> = Vec::new();
        for (slot, l) in inputs.iter().enumerate() {
            if let Layout::Split { dim } = *l {
                let letter = self.split_letter(slot, dim, ranks).ok_or_else(|| {
                    format!("input {slot} is split along dim {dim}, which the op cannot split")
                })?;
                if !letters.contains(&letter) {
                    letters.push(letter);
                }
            }
        }
        let expected = match letters.as_slice() {
            [] if inputs.contains(&Layout::Partial) => {
                let partial = inputs
                    .iter()
                    .position(|l| *l == Layout::Partial)
                    .unwrap_or(0);
                if !inputs
                    .iter()
                    .enumerate()
                    .all(|(i, l)| *l != Layout::Partial || self.linear_in(i as u32, inputs))
                {
                    return Err(format!(
                        "input {partial} is a partial sum but the op is not linear in it \
                         with its other inputs laid out {}",
                        show(inputs)
                    ));
                }
                let wanted = self.keep_partial(inputs).ok_or_else(|| {
                    format!("partial inputs {} cannot stay partial", show(inputs))
                })?;
                if wanted.0 != inputs {
                    return Err(format!(
                        "partial inputs need the others whole: {} rather than {}",
                        show(&wanted.0),
                        show(inputs)
                    ));
                }
                wanted.1
            }
            [] => Layout::Replicated,
            [letter] => {
                let (need, out) = self
                    .split_along(*letter, ranks)
                    .ok_or_else(|| format!("letter {letter} cannot be split"))?;
                if need != inputs {
                    return Err(format!(
                        "splitting {letter} needs inputs {}, got {}",
                        show(&need),
                        show(inputs)
                    ));
                }
                out
            }
            many => {
                return Err(format!(
                    "inputs split along several letters {many:?}; tp splits one"
                ))
            }
        };
        if output == expected {
            Ok(())
        } else {
            Err(format!(
                "inputs {} give output {expected}, not {output}",
                show(inputs)
            ))
        }
    }
}

fn show(layouts: &[Layout]) -> String {
    let parts: Vec<String> = layouts.iter().map(Layout::to_string).collect();
    format!("[{}]", parts.join(", "))
}

impl fmt::Display for OpDims {
    /// `[.., k], [n, k] -> [.., n]; k contracted, n kept`
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let inputs: Vec<String> = self.inputs.iter().map(Operand::to_string).collect();
        if !inputs.is_empty() {
            write!(f, "{} ", inputs.join(", "))?;
        }
        write!(f, "-> {}", self.output)?;
        let roles: Vec<String> = self
            .letters
            .iter()
            .map(|(l, r)| format!("{l} {}", format!("{r:?}").to_lowercase()))
            .collect();
        if !roles.is_empty() {
            write!(f, "; {}", roles.join(", "))?;
        }
        Ok(())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::ir::Groups;

    const R: Layout = Layout::Replicated;
    const P: Layout = Layout::Partial;

    fn s(dim: u32) -> Layout {
        Layout::Split { dim }
    }

    /// One op of every variant, and of every attribute that changes the dims.
    pub(crate) fn samples() -> Vec<Op> {
        vec![
            Op::Input(InputOp {
                kind: InputKind::TokenIds,
            }),
            Op::Param(ParamOp {
                tensor: "w".into(),
                shape: vec![8, 4],
                dtype: None,
                groups: Default::default(),
                quant: None,
            }),
            Op::Embedding(EmbeddingOp::default()),
            Op::Linear(LinearOp::default()),
            Op::Linear(LinearOp {
                weight_order: WeightOrder::InOut,
                exact: None,
            }),
            Op::BiasAdd(BiasAddOp {}),
            Op::Add(AddOp {}),
            Op::Mul(MulOp {}),
            Op::SigmoidGate(SigmoidGateOp {}),
            Op::Activation(ActivationOp {
                kind: ActivationKind::Silu,
            }),
            Op::RmsNorm(RmsNormOp {
                eps: F64(1e-5),
                group: None,
                reduce_input: None,
                with_reduce: false,
            }),
            Op::RmsNorm(RmsNormOp {
                eps: F64(1e-5),
                group: Some(4),
                reduce_input: None,
                with_reduce: false,
            }),
            Op::RmsNorm(RmsNormOp {
                eps: F64(1e-5),
                group: None,
                reduce_input: Some(AllReduceOp::default()),
                with_reduce: false,
            }),
            Op::LayerNorm(LayerNormOp { eps: F64(1e-5) }),
            Op::Rope(RopeOp {
                head_dim: 4,
                rotary_dim: 4,
                theta: F64(1e4),
                scaling: None,
            }),
            Op::Attention(AttentionOp {
                head_dim: 4,
                scale: None,
            }),
            Op::Unfuse(UnfuseOp {
                groups: Groups::default(),
                part: 0,
            }),
            Op::Output(OutputOp {
                name: "logits".into(),
            }),
            Op::AllReduce(AllReduceOp::default()),
            Op::AllGather(AllGatherOp {
                dim: 2,
                unpad_to: None,
                pieces: Vec::new(),
            }),
            Op::AllGather(AllGatherOp {
                dim: 0,
                unpad_to: None,
                pieces: Vec::new(),
            }),
            Op::ReduceScatter(ReduceScatterOp::even(2)),
            Op::LocalSlice(LocalSliceOp::even(2)),
            Op::Route(RouteOp {
                top_k: 2,
                normalize: true,
            }),
            Op::Experts(ExpertsOp {
                act: ActivationKind::Silu,
                split: ExpertSplit::Expert,
            }),
        ]
    }

    /// Tensor ranks of each input of `d` as the IR has them: activations `[B, S, ..]`.
    pub(crate) fn ranks_of(d: &OpDims) -> Vec<usize> {
        d.inputs
            .iter()
            .map(|o| o.dims.len() + if o.ellipsis { TOKEN_DIMS as usize } else { 0 })
            .collect()
    }

    struct Expect {
        dims: &'static str,
        linear: Linearity,
        in_place: bool,
        row_wise: bool,
        collective: bool,
        moves: Option<(Layout, Layout)>,
    }

    /// The table written out once more, per variant, without a wildcard: a new variant
    /// does not compile until it is described here (and in `dims`).
    fn expected(op: &Op) -> Expect {
        use Linearity as L;
        let e = |dims, linear, in_place, row_wise| Expect {
            dims,
            linear,
            in_place,
            row_wise,
            collective: false,
            moves: None,
        };
        let moving = |linear, in_place, row_wise, collective, moves| Expect {
            dims: "[..] -> [..]",
            linear,
            in_place,
            row_wise,
            collective,
            moves: Some(moves),
        };
        match op {
            Op::Input(_) => e("-> [..]", L::None, false, false),
            Op::Param(_) => e("-> []", L::None, false, false),
            Op::Embedding(_) => e(
                "[..], [v, h] -> [.., h]; v lookup, h kept",
                L::None,
                false,
                true,
            ),
            Op::Linear(l) => e(
                match l.weight_order {
                    WeightOrder::OutIn => "[.., k], [n, k] -> [.., n]; k contracted, n kept",
                    WeightOrder::InOut => "[.., k], [k, n] -> [.., n]; k contracted, n kept",
                },
                L::Each(&[0]),
                false,
                true,
            ),
            Op::BiasAdd(_) => e("[.., h], [h] -> [.., h]; h kept", L::Sum(&[0]), true, true),
            Op::Add(_) => e(
                "[.., h], [.., h] -> [.., h]; h kept",
                L::Sum(&[0, 1]),
                true,
                false,
            ),
            Op::Mul(_) => e(
                "[.., h], [.., h] -> [.., h]; h kept",
                L::Each(&[0, 1]),
                true,
                false,
            ),
            Op::SigmoidGate(_) => e(
                "[.., h], [..] -> [.., h]; h kept",
                L::Each(&[0]),
                false,
                false,
            ),
            Op::Activation(_) => e("[.., h] -> [.., h]; h kept", L::None, true, true),
            Op::RmsNorm(n) => Expect {
                collective: n.reduce_input.is_some(),
                ..e(
                    match n.group {
                        Some(_) => "[.., (g e)], [e] -> [.., (g e)]; g kept, e mixed",
                        None => "[.., h], [h] -> [.., h]; h mixed",
                    },
                    L::None,
                    false,
                    true,
                )
            },
            Op::LayerNorm(_) => e(
                "[.., h], [h], [h] -> [.., h]; h mixed",
                L::None,
                false,
                true,
            ),
            Op::Rope(_) => e(
                "[.., (h d)], [..] -> [.., (h d)]; h kept, d mixed",
                L::None,
                true,
                false,
            ),
            Op::Attention(_) => e(
                "[.., (h d)], [.., (h d)], [.., (h d)] -> [.., (h d)]; h kept, d mixed",
                L::None,
                false,
                false,
            ),
            Op::Unfuse(_) => e("[.., h] -> [.., h]; h kept", L::Each(&[0]), false, true),
            Op::Output(_) => e("[..] -> [..]", L::None, false, true),
            Op::AllReduce(_) => moving(L::Each(&[0]), true, true, true, (P, R)),
            Op::AllGather(g) => moving(L::None, false, g.dim >= 2, true, (s(g.dim), R)),
            Op::ReduceScatter(r) => moving(L::Each(&[0]), false, r.dim >= 2, true, (P, s(r.dim))),
            Op::LocalSlice(l) => moving(L::None, false, l.dim >= 2, false, (R, s(l.dim))),
            Op::Route(_) => e("[.., e] -> [.., e]; e mixed", L::None, false, true),
            Op::Experts(_) => e(
                "[.., h], [.., e], [e, f, h], [e, f, h], [e, h, f] -> [.., h]; h mixed, e contracted, f contracted",
                L::None,
                false,
                false,
            ),
        }
    }

    /// The variant names serde knows for `Op`: the derived `Deserialize` hands them to
    /// `deserialize_enum`, which this deserializer records and then refuses.
    fn variant_names() -> Vec<&'static str> {
        use serde::de::{self, Deserialize, Visitor};
        #[derive(Debug)]
        struct Seen(Vec<&'static str>);
        impl std::fmt::Display for Seen {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{:?}", self.0)
            }
        }
        impl std::error::Error for Seen {}
        impl de::Error for Seen {
            fn custom<T: fmt::Display>(_: T) -> Self {
                Seen(vec![])
            }
        }
        struct Probe;
        impl<'de> de::Deserializer<'de> for Probe {
            type Error = Seen;
            fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Seen> {
                Err(Seen(vec![]))
            }
            fn deserialize_enum<V: Visitor<'de>>(
                self,
                _: &'static str,
                variants: &'static [&'static str],
                _: V,
            ) -> Result<V::Value, Seen> {
                Err(Seen(variants.to_vec()))
            }
            serde::forward_to_deserialize_any! {
                bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes
                byte_buf option unit unit_struct newtype_struct seq tuple tuple_struct map
                struct identifier ignored_any
            }
        }
        match Op::deserialize(Probe) {
            Err(Seen(names)) => names,
            Ok(op) => panic!("the probe built {op:?}"),
        }
    }

    #[test]
    fn every_variant_is_sampled() {
        let names = variant_names();
        assert_eq!(names.len(), 21, "{names:?}");
        let sampled: Vec<String> = samples()
            .iter()
            .map(|op| {
                format!("{op:?}")
                    .split('(')
                    .next()
                    .unwrap_or("")
                    .to_string()
            })
            .collect();
        for name in names {
            assert!(sampled.iter().any(|s| s == name), "no sample of Op::{name}");
        }
    }

    #[test]
    fn every_op_is_described_as_expected() {
        for op in samples() {
            let d = dims(&op);
            let want = expected(&op);
            assert_eq!(d.to_string(), want.dims, "{op:?}");
            assert_eq!(d.linear, want.linear, "{op:?}");
            assert_eq!(d.in_place, want.in_place, "{op:?}");
            assert_eq!(d.row_wise, want.row_wise, "{op:?}");
            assert_eq!(d.collective, want.collective, "{op:?}");
            assert_eq!(d.moves, want.moves, "{op:?}");
        }
    }

    #[test]
    fn every_description_is_well_formed() {
        for op in samples() {
            let d = dims(&op);
            assert_eq!(d.inputs.len(), op.arity(), "{op:?}");
            // Exactly the three communicating ops and a norm fused with an all-reduce (a
            // local slice moves no data); only the first three and the slice move layouts.
            let moving = matches!(
                op,
                Op::AllReduce(_) | Op::AllGather(_) | Op::ReduceScatter(_)
            );
            let fused = matches!(op, Op::RmsNorm(ref n) if n.reduce_input.is_some());
            assert_eq!(d.collective, moving || fused, "{op:?}");
            assert_eq!(d.moves.is_some(), moving || matches!(op, Op::LocalSlice(_)));
            let operands: Vec<&Operand> = d.inputs.iter().chain([&d.output]).collect();
            let used: Vec<char> = operands
                .iter()
                .flat_map(|o| o.dims.iter().flat_map(|x| x.chars()))
                .collect();
            for &l in &used {
                assert!(d.role(l).is_some(), "{op:?}: letter {l} has no role");
            }
            for &(l, role) in d.letters {
                assert!(used.contains(&l), "{op:?}: letter {l} is unused");
                // A split splits a dim's first letter, so a splittable letter leads its dim
                // wherever it appears.
                if role.splittable() {
                    for o in &operands {
                        for x in o.dims {
                            assert!(!x.contains(l) || x.starts_with(l), "{op:?}: {l} in {x}");
                        }
                    }
                }
                assert_eq!(
                    d.output.has(l),
                    matches!(role, Role::Kept | Role::Mixed),
                    "{op:?}: only kept and mixed letters reach the output ({l})"
                );
            }
            let slots = match d.linear {
                Linearity::None => &[][..],
                Linearity::Sum(s) | Linearity::Each(s) => s,
            };
            assert!(slots.iter().all(|&s| (s as usize) < op.arity()), "{op:?}");
            if d.in_place {
                assert_eq!(d.inputs.first(), Some(&d.output), "{op:?}");
            }
            if d.row_wise {
                assert!(
                    d.inputs.iter().skip(1).all(|o| !o.ellipsis),
                    "{op:?}: a row-wise op reads only weights beside input 0"
                );
            }
            if let Some((from, _)) = d.moves {
                assert_eq!(op.arity(), 1, "{op:?}");
                assert_eq!(d.linear_in(0, &[from]), from == P, "{op:?}");
            }
        }
    }

    #[test]
    fn splits_map_letters_to_dims() {
        let lin = dims(&Op::Linear(LinearOp::default()));
        let ranks = [3, 2];
        assert_eq!(lin.split_letter(0, 2, &ranks), Some('k'));
        assert_eq!(lin.split_letter(0, 1, &ranks), None, "a token dim");
        assert_eq!(lin.split_letter(1, 0, &ranks), Some('n'));
        assert_eq!(lin.split_letter(1, 2, &ranks), None, "outside the weight");
        assert_eq!(lin.split_along('n', &ranks), Some((vec![R, s(0)], s(2))));
        assert_eq!(lin.split_along('k', &ranks), Some((vec![s(2), s(1)], P)));
        let conv = dims(&Op::Linear(LinearOp {
            weight_order: WeightOrder::InOut,
            exact: None,
        }));
        assert_eq!(conv.split_along('n', &ranks), Some((vec![R, s(1)], s(2))));
        assert_eq!(conv.input_dim_with(1, Role::Contracted, &ranks), Some(0));
        let emb = dims(&Op::Embedding(EmbeddingOp::default()));
        assert_eq!(emb.split_along('v', &[2, 2]), Some((vec![R, s(0)], P)));
        assert_eq!(emb.split_along('h', &[2, 2]), Some((vec![R, s(1)], s(2))));
        let norm = dims(&Op::LayerNorm(LayerNormOp { eps: F64(1e-5) }));
        assert_eq!(norm.split_letter(0, 2, &[3, 1, 1]), None);
        assert_eq!(norm.split_along('h', &[3, 1, 1]), None);
        let rope = dims(&Op::Rope(RopeOp {
            head_dim: 4,
            rotary_dim: 4,
            theta: F64(1e4),
            scaling: None,
        }));
        assert_eq!(rope.split_along('h', &[3, 2]), Some((vec![s(2), R], s(2))));
    }

    #[test]
    fn partial_sums_flow_only_where_the_op_is_linear() {
        let add = dims(&Op::Add(AddOp {}));
        assert!(add.linear_in(0, &[P, P]) && add.linear_in(1, &[R, P]));
        assert_eq!(add.keep_partial(&[P, P]), Some((vec![P, P], P)));
        let mul = dims(&Op::Mul(MulOp {}));
        assert!(!mul.linear_in(0, &[P, P]));
        assert!(mul.linear_in(1, &[R, P]));
        assert!(!mul.linear_in(2, &[R, R]), "no third factor");
        assert_eq!(mul.keep_partial(&[P, P]), Some((vec![P, R], P)));
        let bias = dims(&Op::BiasAdd(BiasAddOp {}));
        assert!(bias.linear_in(0, &[P, R]) && !bias.linear_in(1, &[R, P]));
        let lin = dims(&Op::Linear(LinearOp::default()));
        assert!(lin.linear_in(0, &[P, R]) && !lin.linear_in(0, &[P, s(1)]));
        assert_eq!(lin.keep_partial(&[R, R]), None);
        let act = dims(&Op::Activation(ActivationOp {
            kind: ActivationKind::Relu,
        }));
        assert!(!act.linear_in(0, &[P]));
        assert_eq!(act.keep_partial(&[P]), None);
    }

    #[test]
    fn a_whole_addend_to_a_partial_sum_runs_on_rank_0_only() {
        let add = dims(&Op::Add(AddOp {}));
        assert_eq!(add.rank0_only(&[R, P], P), Some(1));
        assert_eq!(add.rank0_only(&[P, R], P), Some(0));
        assert_eq!(
            add.rank0_only(&[P, P], P),
            None,
            "every rank adds its partials"
        );
        assert_eq!(add.rank0_only(&[R, R], R), None);
        let bias = dims(&Op::BiasAdd(BiasAddOp {}));
        assert_eq!(bias.rank0_only(&[P, R], P), Some(0));
        assert_eq!(bias.rank0_only(&[s(2), s(0)], s(2)), None);
        let mul = dims(&Op::Mul(MulOp {}));
        assert_eq!(
            mul.rank0_only(&[P, R], P),
            None,
            "every rank scales its partial"
        );
    }

    #[test]
    fn admits_judges_layouts_by_the_dims() {
        let lin = dims(&Op::Linear(LinearOp::default()));
        let r = [3, 2];
        assert_eq!(lin.admits(&[R, s(0)], &r, s(2)), Ok(()));
        assert_eq!(lin.admits(&[s(2), s(1)], &r, P), Ok(()));
        assert_eq!(lin.admits(&[P, R], &r, P), Ok(()));
        assert_eq!(lin.admits(&[R, R], &r, R), Ok(()));
        let err = |res: Result<(), String>| res.expect_err("admitted");
        assert!(err(lin.admits(&[s(2), s(1)], &r, R)).contains("give output P"));
        assert!(err(lin.admits(&[s(2), R], &r, P)).contains("splitting k needs"));
        assert!(err(lin.admits(&[s(2), s(0)], &r, P)).contains("several letters"));
        assert!(err(lin.admits(&[P, s(0)], &r, s(2))).contains("splitting n needs"));
        assert!(err(lin.admits(&[s(1), R], &r, s(1))).contains("cannot split"));
        let norm = dims(&Op::RmsNorm(RmsNormOp {
            eps: F64(1e-5),
            group: None,
            reduce_input: None,
            with_reduce: false,
        }));
        assert!(err(norm.admits(&[s(2), R], &[3, 1], s(2))).contains("cannot split"));
        let head_norm = dims(&Op::RmsNorm(RmsNormOp {
            eps: F64(1e-5),
            group: Some(4),
            reduce_input: None,
            with_reduce: false,
        }));
        assert_eq!(head_norm.admits(&[s(2), R], &[3, 1], s(2)), Ok(()));
        let mul = dims(&Op::Mul(MulOp {}));
        assert!(err(mul.admits(&[P, P], &[3, 3], P)).contains("not linear"));
        let add = dims(&Op::Add(AddOp {}));
        assert_eq!(add.admits(&[P, P], &[3, 3], P), Ok(()));
        assert!(err(add.admits(&[R, R], &[3, 3], P)).contains("give output R"));
        let act = dims(&Op::Activation(ActivationOp {
            kind: ActivationKind::Gelu,
        }));
        assert!(err(act.admits(&[P], &[3], P)).contains("not linear"));
        let gather = dims(&Op::AllGather(AllGatherOp {
            dim: 2,
            unpad_to: None,
            pieces: Vec::new(),
        }));
        assert_eq!(gather.admits(&[s(2)], &[3], R), Ok(()));
        assert!(err(gather.admits(&[P], &[3], R)).contains("turns S(2) into R"));
        let out = dims(&Op::Output(OutputOp { name: "y".into() }));
        assert!(out.admits(&[s(2)], &[3], s(2)).is_err());
        assert!(err(out.admits(&[R, R], &[3, 3], R)).contains("takes 1 inputs"));
    }
}
