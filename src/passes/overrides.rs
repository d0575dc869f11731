//! `tp_plan` overrides from the model file: matched to weights and checked, not trusted.

use crate::error::{Result, TpcError};
use crate::frontend::TpWord;
use crate::ir::{Graph, Groups, NodeId, Op};
use rustc_hash::FxHashMap as HashMap;
use std::collections::BTreeMap;

/// Whether `pattern` (dotted, `*` = one segment) matches the tail of `name`.
pub fn pattern_matches(pattern: &str, name: &str) -> bool {
    let p: Vec<&str> = pattern.split('.').collect();
    let n: Vec<&str> = name.split('.').collect();
    if p.len() > n.len() {
        return false;
    }
    n[n.len() - p.len()..]
        .iter()
        .zip(&p)
        .all(|(seg, pat)| *pat == "*" || seg == pat)
}

fn module_of(tensor: &str) -> &str {
    tensor.strip_suffix(".weight").unwrap_or(tensor)
}

/// The override word for each weight a pattern names. Errors for patterns that match no
/// weight, name weights that are not linear or embedding weights, or ask for a vocab split
/// of something that is not a vocabulary.
pub fn resolve_overrides(
    graph: &Graph,
    plan: &BTreeMap<String, TpWord>,
) -> Result<HashMap<NodeId, TpWord>> {
    let mut out = HashMap::default();
    for (pattern, &word) in plan {
        let bad = |reason: String| TpcError::BadOverride {
            pattern: pattern.clone(),
            word: word.word(),
            reason,
        };
        let mut matched = 0;
        for id in graph.g.node_indices() {
            let Op::Param(p) = &graph.node(id).op else {
                continue;
            };
            if !p.tensor.ends_with(".weight") && p.tensor.contains('.') {
                continue;
            }
            if !pattern_matches(pattern, module_of(&p.tensor))
                && !pattern_matches(pattern, &p.tensor)
            {
                continue;
            }
            matched += 1;
            for (user, slot) in graph.users(id) {
                let op = &graph.node(user).op;
                let is_vocab = p.groups_of(0) == (Groups::Plain { padded: true });
                match (op, slot) {
                    (Op::Linear(_), 1) => {
                        if word == TpWord::Vocab && !is_vocab {
                            return Err(bad(format!(
                                "`vocab` splits vocabulary rows, and `{}` is not an LM head; use colwise or rowwise",
                                p.tensor
                            )));
                        }
                    }
                    (Op::Embedding(_), 1) => {}
                    _ => {
                        return Err(bad(format!(
                            "`{}` feeds a {} op; only linear and embedding weights take tp_plan words (others follow automatically)",
                            p.tensor,
                            op.kind()
                        )))
                    }
                }
            }
            out.insert(id, word);
        }
        if matched == 0 {
            let example = graph
                .g
                .node_weights()
                .find_map(|n| match &n.op {
                    Op::Param(p) if p.shape.len() == 2 => Some(module_of(&p.tensor).to_string()),
                    _ => None,
                })
                .unwrap_or_default();
            return Err(bad(format!(
                "it matches no weight of this model; patterns name modules like `{example}`, with `*` for one segment"
            )));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_match_dotted_tails_with_wildcards() {
        assert!(pattern_matches(
            "layers.*.self_attn.q_proj",
            "model.layers.3.self_attn.q_proj"
        ));
        assert!(pattern_matches("lm_head", "lm_head"));
        assert!(!pattern_matches(
            "layers.*.self_attn.q_proj",
            "model.layers.3.self_attn.k_proj"
        ));
        assert!(!pattern_matches("model.layers.0.mlp", "mlp"));
    }
}
