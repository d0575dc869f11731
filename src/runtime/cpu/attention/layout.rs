//! The checked head layout of one attention call.

use super::KvView;
use crate::runtime::tensor::Tensor;

/// The head layout of an attention call, checked: the fast paths index keys and values
/// without checks, so it must be exact.
pub(crate) struct Layout {
    /// Query rows.
    pub t: usize,
    /// Query heads, and query heads per key/value head.
    pub heads: usize,
    pub group: usize,
    /// Values per cached key row, and cached keys.
    pub kcols: usize,
    pub n: usize,
}

impl Layout {
    pub(crate) fn of(q: &Tensor, kv: &KvView, d: usize, kv_heads: usize) -> Layout {
        let (t, qcols) = q.rows_cols();
        assert!(
            d > 0 && kv_heads > 0 && qcols.is_multiple_of(d) && (qcols / d).is_multiple_of(kv_heads),
            "attention: {qcols} query columns are not whole heads of {d} in groups over {kv_heads} kv heads"
        );
        let heads = qcols / d;
        let kcols = kv_heads * d;
        assert!(
            kv.kcols() == kcols,
            "attention: cached rows of {} values are not {kv_heads} heads of {d}",
            kv.kcols()
        );
        let n = kv.len();
        assert!(t <= n, "attention: {t} queries over {n} cached keys");
        Layout {
            t,
            heads,
            group: heads / kv_heads,
            kcols,
            n,
        }
    }
}
