//! Shape inference: one pure function per op from input facts to the output fact.

use super::groups::Groups;
use super::op::*;
use super::tensor::{DType, Dim, Shape, TensorFact};

/// The output fact of `op` given its inputs' facts, or why the inputs do not fit.
pub fn infer(op: &Op, inputs: &[&TensorFact], model_dtype: DType) -> Result<TensorFact, String> {
    if inputs.len() != op.arity() {
        return Err(format!(
            "{} takes {} inputs, got {}",
            op.kind(),
            op.arity(),
            inputs.len()
        ));
    }
    let same = |f: &TensorFact| Ok(f.clone());
    match op {
        Op::Input(_) => Ok(TensorFact {
            dtype: DType::I64,
            shape: Shape::ids(),
        }),
        Op::Param(p) => {
            if p.shape.is_empty() || p.shape.contains(&0) {
                return Err(format!(
                    "weight {} has an empty shape {:?}",
                    p.tensor, p.shape
                ));
            }
            Ok(TensorFact {
                dtype: p.dtype.unwrap_or(model_dtype),
                shape: Shape::fixed(&p.shape),
            })
        }
        Op::Embedding(_) => {
            let (ids, table) = (inputs[0], inputs[1]);
            expect_ids(ids, "embedding ids")?;
            let h = matrix(table, "embedding table")?.1;
            Ok(TensorFact {
                dtype: table.dtype,
                shape: ids.shape.with_appended(h),
            })
        }
        Op::Linear(l) => {
            let (x, w) = (inputs[0], inputs[1]);
            let (r, c) = matrix(w, "linear weight")?;
            let (out, inp) = match l.weight_order {
                WeightOrder::OutIn => (r, c),
                WeightOrder::InOut => (c, r),
            };
            let k = last_fixed(x, "linear input")?;
            if k != inp {
                return Err(format!(
                    "linear input has {k} features but the weight {} expects {inp}",
                    w.shape
                ));
            }
            Ok(TensorFact {
                dtype: x.dtype,
                shape: x.shape.with_last(out),
            })
        }
        Op::BiasAdd(_) => {
            let (x, b) = (inputs[0], inputs[1]);
            vector_matching(b, last_fixed(x, "bias_add input")?, "bias")?;
            same(x)
        }
        Op::Add(_) | Op::Mul(_) => {
            if inputs[0].shape != inputs[1].shape {
                return Err(format!(
                    "{} needs equal shapes, got {} and {}",
                    op.kind(),
                    inputs[0].shape,
                    inputs[1].shape
                ));
            }
            same(inputs[0])
        }
        Op::SigmoidGate(_) => {
            let (x, g) = (inputs[0], inputs[1]);
            let lead = x.shape.rank().saturating_sub(1);
            let fits = g.shape.rank() == x.shape.rank()
                && g.shape.fixed_at(lead) == Some(1)
                && g.shape.0[..lead] == x.shape.0[..lead];
            if !fits {
                return Err(format!(
                    "sigmoid_gate scales {} by one gate value per token, [.., 1], got {}",
                    x.shape, g.shape
                ));
            }
            same(x)
        }
        Op::Activation(_) => same(inputs[0]),
        Op::RmsNorm(n) => {
            let x = inputs[0];
            let h = last_fixed(x, "rms_norm input")?;
            let width = match n.group {
                Some(g) if g == 0 || h % g != 0 => {
                    return Err(format!("rms_norm group {g} does not divide {h} features"))
                }
                Some(g) => g,
                None => h,
            };
            vector_matching(inputs[1], width, "rms_norm weight")?;
            same(x)
        }
        Op::LayerNorm(_) => {
            let x = inputs[0];
            let h = last_fixed(x, "layer_norm input")?;
            vector_matching(inputs[1], h, "layer_norm weight")?;
            vector_matching(inputs[2], h, "layer_norm bias")?;
            same(x)
        }
        Op::Rope(r) => {
            let x = inputs[0];
            expect_ids(inputs[1], "rope positions")?;
            let h = last_fixed(x, "rope input")?;
            if r.head_dim == 0 || h % r.head_dim != 0 {
                return Err(format!("rope head_dim {} does not divide {h}", r.head_dim));
            }
            if r.rotary_dim > r.head_dim || r.rotary_dim % 2 != 0 || r.rotary_dim == 0 {
                return Err(format!(
                    "rope rotary_dim {} must be even, positive and at most head_dim {}",
                    r.rotary_dim, r.head_dim
                ));
            }
            same(x)
        }
        Op::Attention(a) => {
            let (q, k, v) = (inputs[0], inputs[1], inputs[2]);
            let hd = a.head_dim;
            let (qf, kf, vf) = (
                last_fixed(q, "attention q")?,
                last_fixed(k, "attention k")?,
                last_fixed(v, "attention v")?,
            );
            if hd == 0 || qf % hd != 0 || kf % hd != 0 || kf != vf {
                return Err(format!(
                    "attention q/k/v features {qf}/{kf}/{vf} are not whole heads of {hd}"
                ));
            }
            let (nq, nkv) = (qf / hd, kf / hd);
            if nkv == 0 || nq % nkv != 0 {
                return Err(format!(
                    "{nq} query heads cannot be grouped over {nkv} key/value heads"
                ));
            }
            same(q)
        }
        Op::Unfuse(u) => {
            let x = inputs[0];
            let h = last_fixed(x, "unfuse input")?;
            let part_len = unfused_len(&u.groups, u.part, h)?;
            Ok(TensorFact {
                dtype: x.dtype,
                shape: x.shape.with_last(part_len),
            })
        }
        Op::Output(_) | Op::AllReduce(_) | Op::ReduceScatter(_) | Op::LocalSlice(_) => {
            same(inputs[0])
        }
        Op::Route(r) => {
            let experts = last_fixed(inputs[0], "router logits")?;
            if r.top_k == 0 || r.top_k > experts {
                return Err(format!(
                    "the router keeps {} experts per token, which must be 1 to the {experts} experts there are",
                    r.top_k
                ));
            }
            Ok(TensorFact {
                dtype: DType::F32,
                shape: inputs[0].shape.clone(),
            })
        }
        Op::Experts(_) => {
            let (x, routing) = (inputs[0], inputs[1]);
            let h = last_fixed(x, "experts input")?;
            let e = last_fixed(routing, "experts routing")?;
            let want = |f: &TensorFact, what: &str, shape: [Option<u64>; 3]| {
                let dims: Vec<Option<u64>> = (0..3).map(|d| f.shape.fixed_at(d)).collect();
                let fits = f.shape.rank() == 3
                    && dims
                        .iter()
                        .zip(shape)
                        .all(|(got, want)| got.is_some() && (want.is_none() || *got == want));
                if fits {
                    Ok(dims[1].unwrap_or(0))
                } else {
                    Err(format!(
                        "{what} must be [experts {e}, .., ..] matching {h} features, got {}",
                        f.shape
                    ))
                }
            };
            let f = want(inputs[2], "expert gate weights", [Some(e), None, Some(h)])?;
            want(inputs[3], "expert up weights", [Some(e), Some(f), Some(h)])?;
            want(
                inputs[4],
                "expert down weights",
                [Some(e), Some(h), Some(f)],
            )?;
            if routing.shape.rank() != x.shape.rank() {
                return Err(format!(
                    "routing {} and input {} must have the same token dims",
                    routing.shape, x.shape
                ));
            }
            same(x)
        }
        Op::AllGather(g) => match g.unpad_to {
            Some(n) => Ok(TensorFact {
                dtype: inputs[0].dtype,
                shape: inputs[0].shape.with_last(n),
            }),
            None => same(inputs[0]),
        },
    }
}

/// Length of part `part` of a fused dim of `total` elements.
pub fn unfused_len(groups: &Groups, part: u32, total: u64) -> Result<u64, String> {
    let len = match groups {
        Groups::Concat(parts) => parts
            .get(part as usize)
            .and_then(Groups::covered_len)
            .ok_or_else(|| format!("unfuse part {part} is not a sized part of {groups:?}"))?,
        Groups::Interleaved { heads, parts } => {
            heads
                * parts
                    .get(part as usize)
                    .ok_or_else(|| format!("unfuse part {part} out of {} parts", parts.len()))?
        }
        _ => return Err("unfuse needs a Concat or Interleaved structure".into()),
    };
    match groups.covered_len() {
        Some(n) if n == total => Ok(len),
        Some(n) => Err(format!(
            "unfuse structure covers {n} features but the input has {total}"
        )),
        None => Err("unfuse structure has no fixed length".into()),
    }
}

fn expect_ids(f: &TensorFact, what: &str) -> Result<(), String> {
    if f.dtype != DType::I64 || f.shape.rank() != 2 {
        return Err(format!("{what} must be i64 [B, S], got {f}"));
    }
    Ok(())
}

fn matrix(f: &TensorFact, what: &str) -> Result<(u64, u64), String> {
    match (f.shape.rank(), f.shape.fixed_at(0), f.shape.fixed_at(1)) {
        (2, Some(r), Some(c)) => Ok((r, c)),
        _ => Err(format!("{what} must be a fixed 2-D tensor, got {f}")),
    }
}

fn vector_matching(f: &TensorFact, n: u64, what: &str) -> Result<(), String> {
    if f.shape.rank() != 1 || f.shape.fixed_at(0) != Some(n) {
        return Err(format!("{what} must be [{n}], got {}", f.shape));
    }
    Ok(())
}

fn last_fixed(f: &TensorFact, what: &str) -> Result<u64, String> {
    match f.shape.last() {
        Some(Dim::Fixed(n)) if f.shape.rank() >= 2 => Ok(n),
        _ => Err(format!("{what} must end in a fixed feature dim, got {f}")),
    }
}

impl Shape {
    fn with_appended(&self, n: u64) -> Shape {
        let mut s = self.clone();
        s.0.push(Dim::Fixed(n));
        s
    }
}
