//! The shape rules of the [`super::backend::Backend`] contract, in one place: every backend
//! checks its inputs with these before touching memory, so the CPU and the GPU refuse the
//! same calls with the same words.

use super::backend_error::{BackendError, BackendResult};

fn refuse(what: String) -> BackendResult<()> {
    Err(BackendError::Shape(what))
}

/// Attention of q `[rows, qcols]`, k and v `[rows, kcols]` with heads of `d`: the query and
/// kv head counts (query heads a multiple of kv heads).
pub fn attention_heads(
    q: (usize, usize),
    k: (usize, usize),
    v: (usize, usize),
    d: usize,
) -> BackendResult<(usize, usize)> {
    let ((rows, qcols), (krows, kcols), (vrows, vcols)) = (q, k, v);
    let ok = d > 0
        && qcols % d == 0
        && kcols % d == 0
        && kcols == vcols
        && kcols > 0
        && (qcols / d).is_multiple_of(kcols / d)
        && krows == rows
        && vrows == rows;
    if !ok {
        refuse(format!(
            "attention of q [{rows}, {qcols}], k [{krows}, {kcols}], v [{vrows}, {vcols}] with heads of {d}"
        ))?;
    }
    Ok((qcols / d, kcols / d))
}

/// A segment of an attention call over a paged pool of `pool_blocks` blocks of
/// `block_size` tokens: its rows lie in the call's `rows`, its table covers its positions
/// `0..start + rows`, and the blocks it names exist. Returns the positions it attends over.
pub fn paged_segment(
    seg: &super::backend::Segment<'_>,
    rows: usize,
    block_size: usize,
    pool_blocks: usize,
) -> BackendResult<usize> {
    if seg.rows.start >= seg.rows.end || seg.rows.end > rows || block_size == 0 {
        refuse(format!(
            "segment rows {:?} of a call of {rows} rows (blocks of {block_size})",
            seg.rows
        ))?;
    }
    let Some(end) = seg.start.checked_add(seg.rows.len()) else {
        return Err(BackendError::Shape(format!(
            "a segment at position {} overflows",
            seg.start
        )));
    };
    let needed = end.div_ceil(block_size);
    if seg.blocks.len() < needed {
        refuse(format!(
            "a block table of {} blocks of {block_size} tokens for positions up to {end}",
            seg.blocks.len()
        ))?;
    }
    if let Some(b) = seg.blocks[..needed]
        .iter()
        .find(|&&b| b as usize >= pool_blocks)
    {
        refuse(format!(
            "block {b} of a KV pool of {pool_blocks} blocks; grow the pool first"
        ))?;
    }
    Ok(end)
}

/// Columns `offset .. offset + len` of each block of `block` from rows of `n`: the width
/// of the result.
pub fn unfuse(n: usize, block: usize, offset: usize, len: usize) -> BackendResult<usize> {
    if block == 0
        || offset.checked_add(len).is_none_or(|end| end > block)
        || !n.is_multiple_of(block)
    {
        refuse(format!(
            "columns {offset}..{} of blocks of {block} from rows of {n}",
            offset.saturating_add(len)
        ))?;
    }
    Ok(n / block * len)
}

/// Rows of `n` as column blocks of `widths` (a fused product's outputs): at least one
/// block, adding up to `n`.
pub fn split_columns(n: usize, widths: &[usize]) -> BackendResult<()> {
    let total = widths.iter().try_fold(0usize, |a, &w| a.checked_add(w));
    if widths.is_empty() || total != Some(n) {
        refuse(format!(
            "column blocks of {widths:?} from rows of {n}; they must add up to {n}"
        ))?;
    }
    Ok(())
}

/// Column block `k` of `parts` from rows of `n`: its width.
pub fn column_block(n: usize, k: usize, parts: usize) -> BackendResult<usize> {
    if parts == 0 || !n.is_multiple_of(parts) || k >= parts {
        refuse(format!("column block {k} of {parts} from rows of {n}"))?;
    }
    Ok(n / parts)
}

/// Columns `offset .. offset + len` of rows of `n`, padded to `width`: all within the rows
/// and the width.
pub fn column_window(n: usize, offset: usize, len: usize, width: usize) -> BackendResult<()> {
    if offset.checked_add(len).is_none_or(|end| end > n) || len > width {
        refuse(format!(
            "columns {offset}..{offset}+{len} padded to {width} from rows of {n}"
        ))?;
    }
    Ok(())
}

/// Weighted rows added into `[rows, width]`: each part's `(rows, cols)` has `width` columns
/// and one target row (below `rows`) and one weight per row.
pub fn weighted_rows<'p>(
    rows: usize,
    width: usize,
    parts: impl Iterator<Item = ((usize, usize), &'p [usize], &'p [f32])>,
) -> BackendResult<()> {
    rows.checked_mul(width)
        .ok_or_else(|| BackendError::OutOfMemory(format!("[{rows}, {width}]")))?;
    for ((n, cols), at, weights) in parts {
        if (n > 0 && cols != width) || at.len() != n || weights.len() != n {
            refuse(format!(
                "{n} rows of {cols} columns with {} targets and {} weights into rows of {width}",
                at.len(),
                weights.len()
            ))?;
        }
        if let Some(r) = at.iter().find(|&&r| r >= rows) {
            refuse(format!("a weighted row added to row {r} of {rows}"))?;
        }
    }
    Ok(())
}

/// Rows of `n` into `parts` rank-major blocks: a block's width.
pub fn to_rank_major(n: usize, parts: usize) -> BackendResult<usize> {
    if parts == 0 || !n.is_multiple_of(parts) {
        refuse(format!("rows of {n} into {parts} parts"))?;
    }
    Ok(n / parts)
}

/// `all_rows` rank-major rows of `n` from `widths.len()` parts, keeping the first
/// `widths[k]` columns of part `k`: the rows and the kept width.
pub fn from_rank_major(
    all_rows: usize,
    n: usize,
    widths: &[usize],
) -> BackendResult<(usize, usize)> {
    let parts = widths.len();
    if parts == 0 || !all_rows.is_multiple_of(parts) || widths.iter().any(|&w| w > n) {
        refuse(format!(
            "{all_rows} rank-major rows of {n} from {parts} parts, keeping {widths:?} columns of each"
        ))?;
    }
    Ok((all_rows / parts, widths.iter().sum()))
}

/// Whether keeping `widths[k]` columns of each part of `n` is keeping the first
/// `Σ widths` of the joined columns (only end padding dropped).
pub fn is_prefix(widths: &[usize], n: usize) -> bool {
    let short = widths.iter().position(|&w| w < n).unwrap_or(widths.len());
    widths.iter().skip(short + 1).all(|&w| w == 0)
}

/// RMSNorm over groups of `group` columns with `scales` scales on rows of `cols`: the group.
pub fn rms_norm_group(cols: usize, group: usize, scales: usize) -> BackendResult<usize> {
    let group = group.max(1);
    if !cols.is_multiple_of(group) || scales != group {
        refuse(format!(
            "RMSNorm over groups of {group} with {scales} scales on rows of {cols}"
        ))?;
    }
    Ok(group)
}

/// LayerNorm with `scales` scales and `shifts` shifts on rows of `cols`.
pub fn layer_norm(cols: usize, scales: usize, shifts: usize) -> BackendResult<()> {
    if scales != cols || shifts != cols {
        refuse(format!(
            "LayerNorm with {scales} scales and {shifts} shifts on rows of {cols}"
        ))?;
    }
    Ok(())
}

/// `all` rows of `cols` (value, index) pairs in `parts` parts: the rows of one part.
pub fn pairs(all: usize, cols: usize, parts: usize) -> BackendResult<usize> {
    if cols != 2 || parts == 0 || !all.is_multiple_of(parts) {
        refuse(format!("{all}x{cols} pairs in {parts} parts"))?;
    }
    Ok(all / parts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_accept_what_fits_and_refuse_the_rest() {
        assert_eq!(attention_heads((3, 8), (3, 4), (3, 4), 2).unwrap(), (4, 2));
        assert!(
            attention_heads((3, 8), (3, 6), (3, 6), 2).is_err(),
            "4 q heads over 3 kv"
        );
        assert!(
            attention_heads((3, 8), (2, 4), (3, 4), 2).is_err(),
            "rows differ"
        );
        assert!(attention_heads((3, 8), (3, 4), (3, 4), 0).is_err());
        assert_eq!(unfuse(12, 6, 2, 4).unwrap(), 8);
        assert!(unfuse(12, 6, 3, 4).is_err());
        assert!(unfuse(12, 0, 0, 0).is_err());
        assert_eq!(column_block(12, 2, 3).unwrap(), 4);
        assert!(column_window(12, 8, 4, 5).is_ok());
        assert!(column_window(12, 9, 4, 5).is_err());
        assert!(column_window(12, 0, 6, 5).is_err());
        assert!(column_window(12, usize::MAX, 1, 5).is_err());
        assert!(column_block(12, 3, 3).is_err());
        assert_eq!(to_rank_major(12, 4).unwrap(), 3);
        assert!(to_rank_major(12, 5).is_err());
        assert_eq!(from_rank_major(8, 3, &[3, 3, 3, 1]).unwrap(), (2, 10));
        assert_eq!(from_rank_major(8, 3, &[3, 1, 2, 0]).unwrap(), (2, 6));
        assert!(from_rank_major(8, 3, &[3, 4, 3, 3]).is_err());
        assert!(from_rank_major(9, 3, &[3, 3, 3, 3]).is_err());
        assert!(is_prefix(&[3, 3, 1, 0], 3));
        assert!(is_prefix(&[3, 3, 3], 3));
        assert!(!is_prefix(&[3, 1, 3], 3));
        assert!(!is_prefix(&[2, 0, 1], 3));
        assert_eq!(rms_norm_group(8, 4, 4).unwrap(), 4);
        assert_eq!(rms_norm_group(8, 0, 1).unwrap(), 1);
        assert!(rms_norm_group(8, 3, 3).is_err());
        assert!(layer_norm(8, 8, 8).is_ok() && layer_norm(8, 8, 7).is_err());
        assert_eq!(pairs(6, 2, 3).unwrap(), 2);
        assert!(pairs(6, 3, 3).is_err() && pairs(7, 2, 3).is_err());
        assert!(split_columns(12, &[8, 2, 2]).is_ok() && split_columns(4, &[4]).is_ok());
        assert!(split_columns(12, &[8, 2, 3]).is_err());
        assert!(split_columns(12, &[]).is_err());
        assert!(split_columns(3, &[usize::MAX, 4]).is_err(), "overflow");
    }
}
