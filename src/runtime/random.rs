//! Seeded random weights for checking a plan without a checkpoint (`tpc verify`). Every
//! element is a pure function of (seed, tensor name, flat index), so tp=1 and tp=N read
//! the same model whatever slices they take.

use super::weights::WeightError;

type Result<T, E = WeightError> = std::result::Result<T, E>;
use super::weights::WeightSource;
use crate::ir::Op;
use crate::plan::Plan;
use std::collections::HashMap;

#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    /// Norm gains: around 1.
    Gain,
    /// Biases: small.
    Bias,
    /// Matrices: scaled by 1/sqrt(columns) so activations stay O(1).
    Matrix { cols: usize },
}

pub struct RandomWeights {
    seed: u64,
    tensors: HashMap<String, Kind>,
}

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xCBF2_9CE4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01B3)
    })
}

impl RandomWeights {
    /// Random weights for every tensor of `plan` (any tp of the model).
    pub fn new(plan: &Plan, seed: u64) -> RandomWeights {
        let mut tensors = HashMap::new();
        for rank in &plan.ranks {
            let weight_at: HashMap<u32, &str> = rank
                .instrs
                .iter()
                .filter_map(|i| match &i.op {
                    Op::Param(p) => Some((i.id, &*p.tensor)),
                    _ => None,
                })
                .collect();
            for i in &rank.instrs {
                for (slot, id) in i.inputs.iter().enumerate() {
                    let Some(name) = weight_at.get(id) else {
                        continue;
                    };
                    let kind = match (&i.op, slot) {
                        (Op::RmsNorm(_) | Op::LayerNorm(_), 1) => Kind::Gain,
                        (Op::LayerNorm(_), 2) | (Op::BiasAdd(_), 1) => Kind::Bias,
                        _ => {
                            let shape = &rank
                                .weights
                                .iter()
                                .find(|w| &*w.tensor == *name)
                                .map(|w| w.shape.clone())
                                .unwrap_or_default();
                            Kind::Matrix {
                                cols: shape.get(1).copied().unwrap_or(1) as usize,
                            }
                        }
                    };
                    // A stack of experts is read as the experts' own tensors, each a
                    // matrix scaled by its depth (the last dim: h for gate/up, f for down).
                    let shape = rank
                        .weights
                        .iter()
                        .find(|w| &*w.tensor == *name)
                        .map(|w| w.shape.clone())
                        .unwrap_or_default();
                    if let Some(experts) = crate::plan::experts::expert_tensors(name, &shape) {
                        for (tensor, shape) in experts {
                            let cols = shape.last().copied().unwrap_or(1) as usize;
                            tensors.insert(tensor, Kind::Matrix { cols });
                        }
                    }
                    tensors.insert(name.to_string(), kind);
                }
            }
        }
        RandomWeights { seed, tensors }
    }
}

impl WeightSource for RandomWeights {
    fn check(&self, plan: &Plan) -> Result<()> {
        for w in plan.ranks.iter().flat_map(|r| &r.weights) {
            if !self.tensors.contains_key(&*w.tensor) {
                return Err(WeightError::Tensor {
                    path: "random weights".into(),
                    tensor: w.tensor.to_string(),
                    problem: "was not in the plan the random weights were made for".into(),
                });
            }
        }
        Ok(())
    }

    fn read(&self, tensor: &str, from: usize, count: usize, out: &mut Vec<f32>) -> Result<()> {
        let kind = self.tensors.get(tensor).copied().unwrap_or(Kind::Bias);
        let base = mix(self.seed ^ name_hash(tensor));
        let bad = |problem: String| WeightError::Tensor {
            path: "random weights".into(),
            tensor: tensor.to_string(),
            problem,
        };
        if from.checked_add(count).is_none() {
            return Err(bad(format!("elements {from}+{count} overflow")));
        }
        out.try_reserve(count)
            .map_err(|_| bad(format!("no memory for {count} elements")))?;
        out.extend((from..from + count).map(|i| {
            let u = (mix(base.wrapping_add((i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15))) >> 11)
                as f64
                / (1u64 << 53) as f64
                * 2.0
                - 1.0;
            (match kind {
                Kind::Gain => 1.0 + 0.1 * u,
                Kind::Bias => 0.1 * u,
                Kind::Matrix { cols } => 2.0 * u / (cols as f64).sqrt(),
            }) as f32
        }));
        Ok(())
    }
}
