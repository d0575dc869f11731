//! A rank's fused products at run time (`plan::fuse`): the weights of each product are
//! loaded as one, and the product runs once, at its first linear instruction; every linear
//! of the product then gets its block of the product's columns, the first at once and the
//! others when the program reaches them (q's rotary embedding may run in between).

use super::backend::{Backend, BackendError};
use super::error::{Result, RunError};
use super::exact::DepthOrder;
use crate::ir::Op;
use crate::plan::{Instr, RankProgram, WeightSlice};
use std::collections::{HashMap, HashSet};

/// One product: its weight and, in column order, its linears and their output widths.
struct Product<W> {
    weight: W,
    linears: Vec<u32>,
    widths: Vec<usize>,
}

/// The fused products of one rank, with the outputs that wait for their instruction.
pub struct FusedProducts<W, A> {
    products: Vec<Product<W>>,
    /// Per linear id: its product and block.
    member: HashMap<u32, (usize, usize)>,
    /// Blocks computed by their product's first linear, by the id of the linear they are.
    waiting: HashMap<u32, A>,
}

fn bad(name: &str, problem: impl Into<String>) -> RunError {
    RunError::BadInstruction {
        name: name.to_string(),
        problem: problem.into(),
    }
}

/// What the loader needs of a product's linear: its weight's param id and slice.
fn weight_of<'p>(
    by_id: &HashMap<u32, &'p Instr>,
    slices: &HashMap<&str, &'p WeightSlice>,
    linear: u32,
) -> Result<(&'p Instr, u32, &'p WeightSlice)> {
    let i = by_id.get(&linear).ok_or_else(|| {
        bad(
            &format!("%{linear}"),
            "a fused product names it, but the rank has no such instruction",
        )
    })?;
    let weight = *i
        .inputs
        .get(1)
        .ok_or_else(|| bad(&i.name, "a fused linear without a weight"))?;
    let slice = match by_id.get(&weight).map(|w| &w.op) {
        Some(Op::Param(p)) => slices.get(&*p.tensor).copied(),
        _ => None,
    }
    .ok_or_else(|| bad(&i.name, "its weight is not a param in the rank's manifest"))?;
    Ok((i, weight, slice))
}

impl<W, A: super::backend::Activation> FusedProducts<W, A> {
    /// Uploads `program`'s fused products to `backend`, each as one weight; returns them
    /// with the param ids they hold (not to be uploaded again on their own) and their bytes.
    pub fn load<B: Backend<Weight = W, Act = A>>(
        program: &RankProgram,
        src: &dyn super::weights::WeightSource,
        backend: &B,
    ) -> Result<(Self, HashSet<u32>, u64)> {
        let by_id: HashMap<u32, &Instr> = program.instrs.iter().map(|i| (i.id, i)).collect();
        let slices: HashMap<&str, &WeightSlice> =
            program.weights.iter().map(|w| (&*w.tensor, w)).collect();
        let mut products = Vec::with_capacity(program.fused.len());
        let mut member = HashMap::new();
        let mut params = HashSet::new();
        let mut bytes = 0u64;
        for group in &program.fused {
            let mut parts = Vec::with_capacity(group.linears.len());
            let mut order = None;
            for &id in &group.linears {
                let (i, weight, slice) = weight_of(&by_id, &slices, id)?;
                let Op::Linear(l) = &i.op else {
                    return Err(bad(
                        &i.name,
                        "a fused product names it, but it is not a linear",
                    ));
                };
                if order.is_some_and(|o| o != l.weight_order) {
                    return Err(bad(
                        &i.name,
                        "its weight is stored in another order than the first of its fused product",
                    ));
                }
                order = Some(l.weight_order);
                params.insert(weight);
                parts.push((i, slice));
            }
            let first = parts
                .first()
                .map(|(i, _)| i.name.to_string())
                .ok_or_else(|| bad("a fused product", "it names no linears"))?;
            let widths = group
                .columns
                .iter()
                .map(|&c| usize::try_from(c).map_err(|_| bad(&first, "a block wider than memory")))
                .collect::<Result<Vec<_>>>()?;
            if widths.len() != parts.len() {
                return Err(bad(
                    &first,
                    format!(
                        "its fused product lists {} widths for {} linears; it needs one per linear",
                        widths.len(),
                        parts.len()
                    ),
                ));
            }
            let slices: Vec<&WeightSlice> = parts.iter().map(|(_, s)| *s).collect();
            let weight = backend
                .upload_linears(src, &slices, order.unwrap_or_default())
                .map_err(|e| match e {
                    BackendError::Weights(e) => e.into(),
                    error => RunError::Backend {
                        name: first.clone(),
                        error,
                    },
                })?;
            bytes += backend.weight_bytes(&weight) as u64;
            for (k, &id) in group.linears.iter().enumerate() {
                member.insert(id, (products.len(), k));
            }
            products.push(Product {
                weight,
                linears: group.linears.clone(),
                widths,
            });
        }
        let fused = FusedProducts {
            products,
            member,
            waiting: HashMap::new(),
        };
        Ok((fused, params, bytes))
    }

    /// Whether linear `id` runs in a fused product.
    pub fn covers(&self, id: u32) -> bool {
        self.member.contains_key(&id)
    }

    /// The value of linear `i` of a product, `x` its input: the first linear runs the
    /// product (in `invariant`'s order when given) and keeps the other blocks until their
    /// linears ask for them.
    pub fn output<B: Backend<Weight = W, Act = A>>(
        &mut self,
        backend: &B,
        i: &Instr,
        x: &A,
        invariant: Option<DepthOrder>,
    ) -> Result<A> {
        let on = |error| RunError::Backend {
            name: i.name.to_string(),
            error,
        };
        let &(p, block) = self
            .member
            .get(&i.id)
            .ok_or_else(|| bad(&i.name, "it is in no fused product"))?;
        if block > 0 {
            return self.waiting.remove(&i.id).ok_or_else(|| {
                bad(
                    &i.name,
                    "its fused product did not run before it (a bug in tpc)",
                )
            });
        }
        let product = &self.products[p];
        let y = match invariant {
            None => backend.linear(x, &product.weight),
            Some(order) if order.width() == 1 => {
                backend.linear_invariant(x, &product.weight, order)
            }
            Some(_) => {
                return Err(bad(
                    &i.name,
                    "a fused product cannot hold partial sums as limbs (a bug in tpc)",
                ))
            }
        }
        .map_err(on)?;
        let blocks = backend.split_columns(y, &product.widths).map_err(on)?;
        if blocks.len() != product.linears.len() {
            blocks.into_iter().for_each(|b| backend.release(b));
            return Err(bad(&i.name, "the backend split its fused product wrongly"));
        }
        let mut blocks = blocks.into_iter();
        let own = blocks.next();
        // Blocks left from a forward call that failed half way are replaced.
        for (&id, b) in product.linears[1..].iter().zip(blocks) {
            if let Some(stale) = self.waiting.insert(id, b) {
                backend.release(stale);
            }
        }
        own.ok_or_else(|| bad(&i.name, "its fused product has no blocks"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frontend::load::load_model;
    use crate::runtime::backend::WeightUse;
    use crate::runtime::cpu::CpuBackend;
    use crate::runtime::random::RandomWeights;
    use crate::runtime::tensor::Tensor;
    use std::path::Path;

    fn plan(tp: u64) -> crate::plan::Plan {
        let def = load_model(Path::new("models/tiny-llama.ron")).unwrap();
        crate::pipeline::compile(&def, tp).unwrap().plan
    }

    fn instr(program: &RankProgram, id: u32) -> &Instr {
        program.instrs.iter().find(|i| i.id == id).unwrap()
    }

    /// Each linear of a product gets what it would compute on its own, bit for bit, over
    /// one row (a decode step) and several (a prompt); the weights are loaded once.
    #[test]
    fn each_linear_gets_its_own_product_and_its_weight_is_loaded_once() {
        let plan = plan(2);
        let program = &plan.ranks[1];
        let src = RandomWeights::new(&plan, 5);
        let cpu = CpuBackend::new(2);
        let (mut fused, params, bytes) = FusedProducts::load(program, &src, &cpu).unwrap();
        // q, k, v, gate, up of both layers.
        assert_eq!((fused.products.len(), params.len()), (4, 10));
        assert!(bytes > 0);
        for group in &program.fused {
            let width = {
                let first = instr(program, group.linears[0]);
                let x = instr(program, first.inputs[0]);
                x.fact.shape.fixed_at(2).unwrap() as usize
            };
            for rows in [1, 5] {
                let x = Tensor::new(
                    vec![rows, width],
                    (0..rows * width).map(|v| (v as f32 * 0.37).sin()).collect(),
                );
                // In program order, as the executor asks.
                let got: Vec<Tensor> = group
                    .linears
                    .iter()
                    .map(|&id| fused.output(&cpu, instr(program, id), &x, None).unwrap())
                    .collect();
                for (&id, got) in group.linears.iter().zip(&got) {
                    let i = instr(program, id);
                    let Op::Param(p) = &instr(program, i.inputs[1]).op else {
                        panic!()
                    };
                    let slice = program
                        .weights
                        .iter()
                        .find(|w| w.tensor == p.tensor)
                        .unwrap();
                    let usage = WeightUse {
                        linear: Some(crate::ir::WeightOrder::OutIn),
                        other: false,
                    };
                    let alone = cpu.upload(&src, slice, usage).unwrap();
                    let want = cpu.linear(&x, &alone).unwrap();
                    assert_eq!(got.shape, want.shape, "{}", i.name);
                    let bits = |t: &Tensor| t.data.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(got), bits(&want), "{} rows={rows}", i.name);
                }
                assert!(fused.waiting.is_empty());
            }
        }
    }

    #[test]
    fn a_later_linear_before_its_product_ran_is_an_error_and_stale_blocks_are_replaced() {
        let plan = plan(1);
        let program = &plan.ranks[0];
        let src = RandomWeights::new(&plan, 5);
        let cpu = CpuBackend::new(1);
        let (mut fused, _, _) = FusedProducts::load(program, &src, &cpu).unwrap();
        let qkv = &program.fused[0];
        let (q, k) = (
            instr(program, qkv.linears[0]),
            instr(program, qkv.linears[1]),
        );
        let x = Tensor::new(vec![1, 64], vec![0.25; 64]);
        let e = fused.output(&cpu, k, &x, None).unwrap_err();
        assert!(e.to_string().contains("did not run before it"), "{e}");
        // A call that stopped after q: its k and v wait; the next call's q replaces them.
        fused.output(&cpu, q, &x, None).unwrap();
        let x2 = Tensor::new(vec![2, 64], vec![0.5; 128]);
        fused.output(&cpu, q, &x2, None).unwrap();
        assert_eq!(fused.waiting.len(), 2);
        assert_eq!(fused.output(&cpu, k, &x, None).unwrap().shape, vec![2, 16]);
    }
}
