//! `tpc ranks --world W --tp T --pp P --dp D [--json]`: the rank layout and its groups.

use tpc::runtime::rank_groups::{rank_groups, RankGroups};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Total number of ranks (processes or GPUs).
    #[arg(long)]
    world: u64,
    /// Tensor-parallel group size (innermost: consecutive ranks).
    #[arg(long, default_value_t = 1)]
    tp: u64,
    /// Pipeline stages.
    #[arg(long, default_value_t = 1)]
    pp: u64,
    /// Data-parallel replicas inside the layout (ExternalDP takes the rest of the world).
    #[arg(long, default_value_t = 1)]
    dp: u64,
    /// Print the groups and every rank's coordinates as JSON.
    #[arg(long)]
    json: bool,
}

fn list(groups: &[Vec<usize>]) -> String {
    let g: Vec<String> = groups
        .iter()
        .map(|g| {
            let r: Vec<String> = g.iter().map(usize::to_string).collect();
            format!("[{}]", r.join(", "))
        })
        .collect();
    g.join(" ")
}

fn table(g: &RankGroups) -> String {
    let mut s = format!(
        "world {} = ExternalDP {} × DP {} × PP {} × TP {} (TP innermost)\n",
        g.world, g.ext_dp, g.dp, g.pp, g.tp
    );
    for (name, groups) in [
        ("TP", &g.tp_groups),
        ("PP", &g.pp_groups),
        ("DP", &g.dp_groups),
        ("EP", &g.ep_groups),
    ] {
        s.push_str(&format!("{name} groups: {}\n", list(groups)));
    }
    s.push_str("rank  ext_dp  dp  pp  tp\n");
    for c in &g.ranks {
        s.push_str(&format!(
            "{:>4}  {:>6}  {:>2}  {:>2}  {:>2}\n",
            c.rank, c.ext_dp, c.dp, c.pp, c.tp
        ));
    }
    s
}

pub fn execute(a: Args) -> anyhow::Result<()> {
    let g = rank_groups(a.world, a.tp, a.pp, a.dp)?;
    let text = if a.json {
        format!("{}\n", serde_json::to_string_pretty(&g)?)
    } else {
        table(&g)
    };
    super::print_stdout(&text)
}
