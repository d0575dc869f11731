//! Graphviz pictures of a plan: rank 0 by default or every rank; edges labelled with
//! layouts and local shapes, collectives highlighted with their bytes per token,
//! column→row regions boxed, one cluster per layer.

use super::stages::{stage_program, Boundary};
use super::{Plan, RankProgram};
use crate::ir::Op;
use std::collections::{BTreeMap, HashMap};
use std::fmt::Write;

#[derive(Debug, Clone, Default)]
pub struct DotOptions {
    /// Draw every rank, with each collective joining them.
    pub all_ranks: bool,
    /// Only these layers (inclusive range); layers outside are elided.
    pub layers: Option<(u32, u32)>,
}

/// Nodes above which a picture is too large to be useful: nobody reads it, and Graphviz
/// takes seconds to minutes over it (Graphviz 2.43 on a shared 2-core host: one rank of
/// Llama-3-8B's first 16 layers, 297 nodes, 4 s; both ranks of its first 12, 400 nodes, 2 min).
/// Every tiny model at tp ≤ 8, every rank, stays below it.
pub const READABLE_NODES: usize = 300;

/// A rendered picture and the number of nodes in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Picture {
    pub text: String,
    pub nodes: usize,
}

impl Picture {
    /// True when the picture has more than [`READABLE_NODES`] nodes.
    pub fn too_large(&self) -> bool {
        self.nodes > READABLE_NODES
    }
}

fn esc(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"")
}

/// Where each instruction goes: which layer cluster and which region box.
struct Placement {
    region_of: HashMap<String, usize>,
}

impl Placement {
    fn new(plan: &Plan) -> Placement {
        let mut region_of = HashMap::new();
        for (i, r) in plan.regions.iter().enumerate() {
            for m in &r.members {
                region_of.insert(m.clone(), i);
            }
        }
        Placement { region_of }
    }
}

fn shown(layer: Option<u32>, o: &DotOptions) -> bool {
    match (layer, o.layers) {
        (Some(l), Some((a, b))) => l >= a && l <= b,
        _ => true,
    }
}

fn node_label(
    plan: &Plan,
    i: &super::Instr,
    weights: &HashMap<u32, String>,
) -> (String, &'static str) {
    let short = i
        .name
        .rsplit_once(".layers.")
        .map_or(&*i.name, |(_, rest)| rest);
    let short = short.rsplit_once(".h.").map_or(short, |(_, rest)| rest);
    let mut label = format!("{short}\\n{}", i.op.kind());
    let attrs = i.op.attrs();
    if !attrs.is_empty() && !matches!(i.op, Op::Param(_)) {
        label.push_str(&format!(" {{{}}}", esc(&attrs)));
    }
    for w in i.inputs.iter().filter_map(|a| weights.get(a)) {
        label.push_str(&format!("\\nW {w}"));
    }
    label.push_str(&format!("\\n{} {}", i.fact, i.layout));
    if i.op.is_collective() {
        if let Some(c) = plan.collectives.iter().find(|c| c.id == i.id) {
            label.push_str(&format!(
                "\\n{} B/token (ring wire {} B)",
                c.bytes_per_token, c.ring_wire_bytes_per_token
            ));
        }
        return (
            label,
            "shape=box, style=\"filled,bold\", fillcolor=\"#ffb3a7\", color=\"#c0392b\"",
        );
    }
    let style = match i.op {
        Op::Input(_) | Op::Output(_) => "shape=oval, style=filled, fillcolor=\"#dfe6e9\"",
        Op::LocalSlice(_) => "shape=box, style=\"filled,dashed\", fillcolor=\"#fdf2d0\"",
        _ => "shape=box, style=rounded",
    };
    (label, style)
}

/// Weight descriptions by value id ("[64, 32] S(0)") for labels of ops that read them; a
/// padded piece (an uneven split, `--tp-shares`) says how much of its split dim is real.
fn weight_notes(r: &RankProgram) -> HashMap<u32, String> {
    r.instrs
        .iter()
        .filter_map(|i| match &i.op {
            Op::Param(p) => Some((i, p)),
            _ => None,
        })
        .map(|(i, p)| {
            let mut note = format!("{} {}", i.fact.shape, i.layout);
            let slice = r.weights.iter().find(|w| w.tensor == p.tensor);
            if let Some(w) = slice.filter(|w| w.pad_len() > 0) {
                let _ = write!(note, " real {}+{} pad", w.real_len(), w.pad_len());
            }
            (i.id, note)
        })
        .collect()
}

/// Draws one rank's program (its layers as clusters, column→row regions boxed) and its
/// edges; returns the number of nodes drawn.
fn rank_body(
    out: &mut String,
    plan: &Plan,
    r: &RankProgram,
    prefix: &str,
    o: &DotOptions,
    place: &Placement,
    recv: &[Boundary],
) -> usize {
    let weights = weight_notes(r);
    let local: HashMap<u32, &super::Instr> = r.instrs.iter().map(|i| (i.id, i)).collect();
    let received: HashMap<u32, &Boundary> = recv.iter().map(|b| (b.id, b)).collect();
    // Layer → region → nodes; `None` keys hold nodes outside layers / regions.
    let mut tree: BTreeMap<Option<u32>, BTreeMap<Option<usize>, Vec<String>>> = BTreeMap::new();
    let mut elided = false;
    let mut nodes = 0;
    for i in &r.instrs {
        if matches!(i.op, Op::Param(_)) {
            continue;
        }
        if !shown(i.layer, o) {
            elided = true;
            continue;
        }
        if o.all_ranks && i.op.is_collective() {
            continue; // drawn once, between the ranks
        }
        let (label, style) = node_label(plan, i, &weights);
        let line = format!("\"{prefix}{}\" [label=\"{label}\", {style}];", i.id);
        nodes += 1;
        let region = place.region_of.get(&*i.name).copied();
        tree.entry(i.layer)
            .or_default()
            .entry(region)
            .or_default()
            .push(line);
    }
    for (layer, regions) in &tree {
        let indent = if layer.is_some() { "    " } else { "  " };
        if let Some(l) = layer {
            let _ = writeln!(out, "  subgraph \"cluster_{prefix}layer_{l}\" {{");
            let _ = writeln!(
                out,
                "    label=\"layer {l}\"; style=rounded; color=\"#7f8c8d\";"
            );
        }
        for (region, lines) in regions {
            if let Some(k) = region {
                let _ = writeln!(out, "{indent}subgraph \"cluster_{prefix}region_{k}\" {{");
                let _ = writeln!(out, "{indent}  label=\"column→row: no communication\"; style=dashed; color=\"#2980b9\";");
            }
            for line in lines {
                let _ = writeln!(out, "{indent}  {line}");
            }
            if region.is_some() {
                let _ = writeln!(out, "{indent}}}");
            }
        }
        if layer.is_some() {
            let _ = writeln!(out, "  }}");
        }
    }
    if elided {
        nodes += 1;
        let _ = writeln!(
            out,
            "  \"{prefix}elided\" [label=\"… other layers …\", shape=plaintext];"
        );
    }
    let name_of = |id: u32, p: &str| -> Option<String> {
        let i = local.get(&id)?;
        if !shown(i.layer, o) {
            return Some(format!("\"{p}elided\""));
        }
        if o.all_ranks && i.op.is_collective() {
            return Some(format!("\"coll_{id}\""));
        }
        Some(format!("\"{p}{id}\""))
    };
    let mut drawn = std::collections::HashSet::new();
    for i in &r.instrs {
        if matches!(i.op, Op::Param(_)) || !shown(i.layer, o) {
            continue;
        }
        let is_shared = o.all_ranks && i.op.is_collective();
        for &a in &i.inputs {
            if let (Some(b), Some(to)) = (received.get(&a), name_of(i.id, prefix)) {
                let _ = writeln!(
                    out,
                    "  \"{prefix}{a}\" -> {to} [label=\"{}\"];",
                    b.fact.shape
                );
                continue;
            }
            let Some(src) = local.get(&a) else { continue };
            if matches!(src.op, Op::Param(_)) {
                continue;
            }
            let (Some(from), Some(to)) = (name_of(a, prefix), name_of(i.id, prefix)) else {
                continue;
            };
            if !drawn.insert((from.clone(), to.clone())) {
                continue;
            }
            let label = format!("{} {}", src.layout, src.fact.shape);
            let color = if is_shared || src.op.is_collective() {
                ", color=\"#c0392b\""
            } else {
                ""
            };
            let _ = writeln!(out, "  {from} -> {to} [label=\"{label}\"{color}];");
        }
    }
    nodes
}

/// Renders the picture as DOT text.
pub fn render(plan: &Plan, o: &DotOptions) -> String {
    draw(plan, o).text
}

/// Renders the picture and counts its nodes.
pub fn draw(plan: &Plan, o: &DotOptions) -> Picture {
    let place = Placement::new(plan);
    let mut out = String::new();
    let mut nodes = 0;
    let _ = writeln!(out, "digraph tpc {{");
    let view = if o.all_ranks {
        "all ranks".to_string()
    } else {
        "rank 0".to_string()
    };
    let shares = match plan.source.as_ref().and_then(|s| s.shares) {
        Some(s) => format!(" shares {s}"),
        None => String::new(),
    };
    let _ = writeln!(
        out,
        "  label=\"{} — tp={}{shares} — {view}\\nedges: layout (R replicated, S(d) split on dim d, P partial sums) and local shape\"; labelloc=t;",
        esc(&plan.model),
        plan.tp
    );
    let _ = writeln!(out, "  rankdir=TB; node [fontname=\"Helvetica\", fontsize=10]; edge [fontname=\"Helvetica\", fontsize=8];");
    if o.all_ranks {
        // Collectives sit outside the rank clusters and join them; Graphviz 2.43's
        // per-cluster ranking fails on that ("trouble in init_rank"), one global ranking
        // does not. Only here: on one rank's tall chain of layers it is many times slower.
        let _ = writeln!(out, "  newrank=true;");
    }
    if plan.pipeline.is_some() {
        nodes += render_stages(&mut out, plan, o, &place);
    } else if o.all_ranks {
        for r in &plan.ranks {
            let prefix = format!("r{}_", r.rank);
            let _ = writeln!(
                out,
                "subgraph \"cluster_rank_{}\" {{ label=\"rank {}\"; color=\"#34495e\";",
                r.rank, r.rank
            );
            nodes += rank_body(&mut out, plan, r, &prefix, o, &place, &[]);
            let _ = writeln!(out, "}}");
        }
        if let Some(r0) = plan.ranks.first() {
            let weights = weight_notes(r0);
            for i in r0
                .instrs
                .iter()
                .filter(|i| i.op.is_collective() && shown(i.layer, o))
            {
                let (label, style) = node_label(plan, i, &weights);
                let _ = writeln!(out, "  \"coll_{}\" [label=\"{label}\", {style}];", i.id);
                nodes += 1;
            }
        }
    } else if let Some(r0) = plan.ranks.first() {
        nodes += rank_body(&mut out, plan, r0, "", o, &place, &[]);
    }
    let _ = writeln!(out, "}}");
    Picture { text: out, nodes }
}

/// A pipelined plan: one cluster per stage (of tp rank 0, or of every rank), each stage's
/// received values drawn as its first nodes and joined to the sender on the stage before.
/// Returns the number of nodes drawn.
fn render_stages(out: &mut String, plan: &Plan, o: &DotOptions, place: &Placement) -> usize {
    let mut nodes = 0;
    let tps = if o.all_ranks { plan.ranks.len() } else { 1 };
    let prefix = |s: usize, t: usize| {
        if o.all_ranks {
            format!("r{}_", s * plan.ranks.len() + t)
        } else {
            format!("s{s}_")
        }
    };
    for s in 0..plan.pp() {
        for t in 0..tps {
            let sp = match stage_program(plan, t, s) {
                Ok(sp) => sp,
                Err(e) => {
                    let _ = writeln!(out, "  // stage {s}, tp rank {t}: {}", esc(&e.to_string()));
                    continue;
                }
            };
            let p = prefix(s, t);
            let _ = writeln!(
                out,
                "subgraph \"cluster_{p}stage\" {{ label=\"stage {s} — rank {} (tp rank {t})\"; color=\"#8e44ad\"; style=bold;",
                sp.program.rank
            );
            nodes += sp.recv.len();
            for b in &sp.recv {
                let _ = writeln!(
                    out,
                    "  \"{p}{}\" [label=\"recv {}\\nfrom stage {}\\n{}\", shape=cds, style=filled, fillcolor=\"#d7bde2\"];",
                    b.id,
                    esc(&b.name),
                    s.saturating_sub(1),
                    b.fact
                );
            }
            nodes += rank_body(out, plan, &sp.program, &p, o, place, &sp.recv);
            let _ = writeln!(out, "}}");
            if s > 0 {
                let from = prefix(s - 1, t);
                for b in &sp.recv {
                    let _ = writeln!(
                        out,
                        "  \"{from}{id}\" -> \"{p}{id}\" [label=\"send/recv {} B/token\", color=\"#8e44ad\", style=bold];",
                        b.bytes_per_token(),
                        id = b.id
                    );
                }
            }
        }
    }
    if o.all_ranks {
        for s in 0..plan.pp() {
            let Ok(sp) = stage_program(plan, 0, s) else {
                continue;
            };
            let weights = weight_notes(&sp.program);
            for i in sp
                .program
                .instrs
                .iter()
                .filter(|i| i.op.is_collective() && shown(i.layer, o))
            {
                let (label, style) = node_label(plan, i, &weights);
                let _ = writeln!(out, "  \"coll_{}\" [label=\"{label}\", {style}];", i.id);
                nodes += 1;
            }
        }
    }
    nodes
}
