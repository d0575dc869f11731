//! The text `tpc explain` prints: one paragraph per weight (repeated layers once).

use super::{Alternative, Explanation, Link, WeightExplain};
use crate::plan::report::human_bytes;
use std::fmt::Write;

/// `name` without the dotted prefix it shares with `base`'s module (`model.layers.0.mlp.`).
fn short<'a>(name: &'a str, base: &str) -> &'a str {
    let module = base.rsplit_once('.').map_or("", |(m, _)| m);
    if module.is_empty() {
        return name;
    }
    name.strip_prefix(module)
        .and_then(|rest| rest.strip_prefix('.'))
        .unwrap_or(name)
}

fn signed_bytes(d: i64) -> String {
    match d {
        0 => "±0 B".into(),
        d if d > 0 => format!("+{}", human_bytes(d.unsigned_abs())),
        d => format!("−{}", human_bytes(d.unsigned_abs())),
    }
}

fn layout_words(layout: &str, dim: Option<u32>, vocab: bool) -> String {
    match (layout, dim) {
        ("replicated", _) | (_, None) => "replicated (every rank holds it whole)".into(),
        ("split", Some(d)) => format!("split, dim {d} (as its op's activation)"),
        (kind, Some(d)) => format!(
            "{kind} split, dim {d}{}",
            if vocab { " (the vocabulary)" } else { "" }
        ),
    }
}

fn decided(w: &WeightExplain) -> String {
    let by = &w.decided_by;
    let mut s = format!("by `{}` ({})", by.name, by.op);
    let chain: Vec<String> = w
        .chain
        .iter()
        .map(|l: &Link| format!("{} {}", short(&l.name, &by.name), l.layout))
        .collect();
    if !chain.is_empty() {
        let _ = write!(s, ", reading {}", chain.join(" ← "));
    }
    if !w.opened_by.is_empty() {
        let opened: Vec<&str> = w.opened_by.iter().map(|o| short(o, &by.name)).collect();
        let _ = write!(
            s,
            "\n              split by column-split {}",
            opened.join(", ")
        );
    }
    s
}

fn causes(w: &WeightExplain) -> String {
    if w.collectives.is_empty() {
        return match (w.layout.as_str(), w.rule.as_str()) {
            ("column", _) => {
                "nothing: its split output stays split until a row split closes the region".into()
            }
            _ => "nothing".into(),
        };
    }
    let lines: Vec<String> = w
        .collectives
        .iter()
        .map(|c| {
            let mut s = format!(
                "{} `{}`, {} per token",
                c.kind,
                c.value,
                human_bytes(c.bytes_per_token)
            );
            if c.count > 1 {
                let _ = write!(
                    s,
                    " (one per layer: {} in all)",
                    human_bytes(c.bytes_per_token.saturating_mul(c.count))
                );
            }
            if !c.shared_with.is_empty() {
                let _ = write!(s, ", shared with {}", c.shared_with.join(", "));
            }
            s
        })
        .collect();
    lines.join("\n              ")
}

fn instead(w: &WeightExplain) -> String {
    let alone = if w.tensors.len() > 1 { " alone" } else { "" };
    match &w.alternative {
        Alternative::None { reason } => format!("— ({reason})"),
        Alternative::Infeasible {
            word,
            forced,
            reason,
        } => format!("`{word}` on `{forced}`{alone} does not compile: {reason}"),
        Alternative::Feasible {
            word,
            forced,
            layout,
            dim,
            collective_bytes_per_token_delta,
            collectives_delta,
            param_bytes_per_rank_delta,
        } => {
            let kinds: Vec<String> = collectives_delta
                .iter()
                .map(|(k, d)| format!("{k} {d:+}"))
                .collect();
            format!(
                "`{word}` on `{forced}`{alone} → {}: collectives {} per token{}, params per rank {}",
                layout_words(layout, *dim, false),
                signed_bytes(*collective_bytes_per_token_delta),
                if kinds.is_empty() {
                    String::new()
                } else {
                    format!(" ({})", kinds.join(", "))
                },
                signed_bytes(*param_bytes_per_rank_delta)
            )
        }
    }
}

/// The whole explanation as text.
pub fn render_text(e: &Explanation) -> String {
    let tensors: usize = e.weights.iter().map(|w| w.tensors.len()).sum();
    let mut out = format!(
        "{} at tp={}{}: {} weight{} in {} entr{} (repeated layers once). Bytes per token are {} messages, as `tpc compile --json` counts them.\n",
        e.model,
        e.tp,
        match &e.shares {
            Some(s) => format!(" (--tp-shares {s})"),
            None => String::new(),
        },
        tensors,
        if tensors == 1 { "" } else { "s" },
        e.weights.len(),
        if e.weights.len() == 1 { "y" } else { "ies" },
        e.dtype
    );
    for w in &e.weights {
        let shape: Vec<String> = w.shape.iter().map(u64::to_string).collect();
        let _ = writeln!(out, "\n{}  [{}]", w.tensor, shape.join(", "));
        let _ = writeln!(
            out,
            "  layout      {}; {} per rank",
            layout_words(&w.layout, w.dim, w.vocab_dim),
            human_bytes(w.bytes_per_rank)
        );
        if let (false, Some(dim)) = (w.pieces.is_empty(), w.dim) {
            let list: Vec<String> = w.pieces.iter().map(u64::to_string).collect();
            let largest = w.pieces.iter().max().copied().unwrap_or(0);
            let _ = writeln!(
                out,
                "  pieces      {} of {} along dim {dim}, rank by rank (each padded to {largest}, the largest)",
                list.join("/"),
                w.shape.get(dim as usize).copied().unwrap_or(0)
            );
        }
        if let Some(stored) = &w.stored {
            let _ = writeln!(out, "  stored      {stored}");
        }
        let _ = writeln!(out, "  rule        {}", w.why);
        let _ = writeln!(out, "  decided     {}", decided(w));
        for other in &w.also_read_by {
            let _ = writeln!(
                out,
                "  also read   by `{}` ({}), which takes this layout as given (tied weight)",
                other.name, other.op
            );
        }
        let _ = writeln!(out, "  causes      {}", causes(w));
        let _ = writeln!(out, "  instead     {}", instead(w));
    }
    out
}
