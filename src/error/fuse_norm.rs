//! Why a norm marked `with_reduce` (`plan/fuse_norm.rs`) cannot run in one step with its
//! all-reduce.

/// Why a marked norm makes no group with the all-reduce before it; each says what would be
/// right.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReduceNormProblem {
    #[error("both fuse it with an all-reduce (`reduce_input`, the fast fusion) and mark it `with_reduce`; keep one")]
    BothFusions,
    #[error("is marked `with_reduce` in a plan of fast numerics; that fusion exists for `--numerics invariant` (the fast one is `reduce_input`)")]
    FastPlan,
    #[error("reads %{input}, which this rank does not compute; a fused norm reads its all-reduce or the residual add of it")]
    Missing { input: u32 },
    #[error("reads %{input}, neither an all-reduce nor an add of one; a fused norm reads its all-reduce or the residual add of it")]
    NotAfterReduce { input: u32 },
    #[error("reads the add %{add}, whose all-reduce %{reduce} is also read by something else; the fused step hands on only the add's value")]
    SharedReduce { add: u32, reduce: u32 },
    #[error("reads the add %{add}, whose residual %{residual} is computed after its all-reduce %{reduce}; the fused step needs the residual first")]
    LateResidual {
        add: u32,
        reduce: u32,
        residual: u32,
    },
    #[error("joins the all-reduce %{reduce}, which another marked norm joins already; an all-reduce runs in one fused step")]
    Repeated { reduce: u32 },
}
