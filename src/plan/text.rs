//! Deterministic text form of a plan (used for golden tests and `--text`).

use super::stages::{stage_program, StageProgram};
use super::{Plan, RankProgram};
use std::fmt::Write;

fn weight_line(w: &super::WeightSlice) -> String {
    let dims = |v: &[u64]| v.iter().map(u64::to_string).collect::<Vec<_>>().join(", ");
    match w.dim {
        None => format!("{} {}[{}] whole", w.tensor, w.dtype, dims(&w.shape)),
        Some(d) => {
            let ranges: Vec<String> = w
                .ranges
                .iter()
                .map(|r| match r.pad {
                    0 => format!("{}..{}", r.offset, r.offset + r.len),
                    pad => format!("{}..{} +{pad}", r.offset, r.offset + r.len),
                })
                .collect();
            let pad = if w.padding > 0 {
                format!(" +{} pad", w.padding)
            } else {
                String::new()
            };
            format!(
                "{} {}[{}] dim {d} [{}]{pad} -> [{}]",
                w.tensor,
                w.dtype,
                dims(&w.shape),
                ranges.join(", "),
                dims(&w.local_shape)
            )
        }
    }
}

/// One rank's program.
pub fn render_rank(r: &RankProgram) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "rank {}:", r.rank);
    render_body(&mut out, r, &[], &[]);
    out
}

/// One global rank of a pipelined plan: its stage program between the values it receives
/// from the previous stage and those it sends to the next.
pub fn render_stage(sp: &StageProgram, tp_rank: usize) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "rank {} (stage {} of {}, tp rank {tp_rank}):",
        sp.program.rank, sp.stage, sp.stages
    );
    let recv: Vec<String> = sp
        .recv
        .iter()
        .map(|b| {
            format!(
                "%{} = recv() {{from stage {}}} : {}  // {}",
                b.id,
                sp.stage.saturating_sub(1),
                b.fact,
                b.name
            )
        })
        .collect();
    let send: Vec<String> = sp
        .send
        .iter()
        .map(|b| {
            format!(
                "send(%{}) {{to stage {}}}  // {}",
                b.id,
                sp.stage + 1,
                b.name
            )
        })
        .collect();
    render_body(&mut out, &sp.program, &recv, &send);
    out
}

fn render_body(out: &mut String, r: &RankProgram, before: &[String], after: &[String]) {
    let _ = writeln!(out, "  weights:");
    for w in &r.weights {
        let _ = writeln!(out, "    {}", weight_line(w));
    }
    let _ = writeln!(out, "  program:");
    for line in before {
        let _ = writeln!(out, "    {line}");
    }
    for i in &r.instrs {
        let args: Vec<String> = i.inputs.iter().map(|a| format!("%{a}")).collect();
        let attrs = i.op.attrs();
        let attrs = if attrs.is_empty() {
            String::new()
        } else {
            format!(" {{{attrs}}}")
        };
        let layer = i
            .layer
            .map(|l| format!("  # layer {l}"))
            .unwrap_or_default();
        let _ = writeln!(
            out,
            "    %{} = {}({}){attrs} : {} {}  // {}{layer}",
            i.id,
            i.op.kind(),
            args.join(", "),
            i.fact,
            i.layout,
            i.name
        );
    }
    for line in after {
        let _ = writeln!(out, "    {line}");
    }
    render_fused(out, r);
}

/// The products that run several linears at once: which, on what, and their columns.
fn render_fused(out: &mut String, r: &RankProgram) {
    if r.fused.is_empty() {
        return;
    }
    let _ = writeln!(out, "  fused products:");
    for g in &r.fused {
        let find = |id: &u32| r.instrs.iter().find(|i| i.id == *id);
        let ids: Vec<String> = g.linears.iter().map(|id| format!("%{id}")).collect();
        let names: Vec<&str> = g
            .linears
            .iter()
            .filter_map(|id| find(id).map(|i| &*i.name))
            .collect();
        let input = g
            .linears
            .first()
            .and_then(find)
            .and_then(|i| i.inputs.first())
            .map(|x| format!("%{x}"))
            .unwrap_or_default();
        let columns: Vec<String> = g.columns.iter().map(u64::to_string).collect();
        let _ = writeln!(
            out,
            "    {} = one linear of {input}, columns {}  // {}",
            ids.join(" | "),
            columns.join(" | "),
            super::fuse::describe(&names)
        );
    }
}

/// The whole plan: header, notes, collectives and every rank.
pub fn render_plan(plan: &Plan) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "plan v{} model {} tp={} dtype={}",
        plan.version, plan.model, plan.tp, plan.dtype
    );
    for n in &plan.notes {
        let _ = writeln!(out, "note: {n}");
    }
    let _ = writeln!(out, "collectives:");
    for c in &plan.collectives {
        let layer = c.layer.map(|l| l.to_string()).unwrap_or_else(|| "-".into());
        let _ = writeln!(
            out,
            "  %{} {} layer {layer}: {} elements/token, {} B/token, ring wire {} B/token  // {}",
            c.id,
            c.kind,
            c.elements_per_token,
            c.bytes_per_token,
            c.ring_wire_bytes_per_token,
            c.name
        );
    }
    let _ = writeln!(out, "column->row pairs:");
    for r in &plan.regions {
        let _ = writeln!(
            out,
            "  [{}] -> [{}]",
            r.columns.join(", "),
            r.rows.join(", ")
        );
    }
    if let Some(p) = &plan.pipeline {
        for (s, span) in p.stages.iter().enumerate() {
            let _ = writeln!(
                out,
                "stage {s}: layers {}..{}",
                span.first_layer,
                u64::from(span.first_layer) + u64::from(span.layers)
            );
        }
        for s in 0..plan.pp() {
            for t in 0..plan.ranks.len() {
                match stage_program(plan, t, s) {
                    Ok(sp) => out.push_str(&render_stage(&sp, t)),
                    Err(e) => {
                        let _ = writeln!(out, "stage {s}, tp rank {t}: {e}");
                    }
                }
            }
        }
        return out;
    }
    for r in &plan.ranks {
        out.push_str(&render_rank(r));
    }
    out
}
