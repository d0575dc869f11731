//! The module graph is one-way: a test reads the sources and fails when a module cycle
//! appears, between the crate's top-level modules (ir → frontend → passes → plan →
//! pipeline → cost → runtime, with cli the binary above them all) and between the modules
//! inside `runtime/` (there each device folder, `cpu/` and `cuda/`, counts as its files: a
//! device's launcher sits above the generic launcher while its kernels sit below it).
//!
//! A reference counts where code names a module: `crate::x`, and `super::x` from a file
//! directly under the folder compared. Comments do not count; tests do, as the compiler
//! sees them: a test that needs a whole compiled model lives at or above the layer that
//! compiles one (`plan::build`, or `pipeline/tests` for what frontend and passes made of it).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Module → the modules it references.
type Graph = BTreeMap<String, BTreeSet<String>>;

/// The code of a source file without its comment lines.
fn code_of(text: &str) -> String {
    let mut out = String::new();
    for line in text.lines() {
        if !line.trim_start().starts_with("//") {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// The names a path reference starting at `prefix` reaches: `prefix::a` gives `a`,
/// `prefix::{a, b::c}` gives `a` and `b`.
fn names_after(code: &str, prefix: &str) -> Vec<String> {
    let mut names = Vec::new();
    for (at, _) in code.match_indices(prefix) {
        // `super::super::x` is not `super::x`; `xcrate::` is not `crate::`.
        let before = code[..at].chars().next_back();
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
            continue;
        }
        let after = &code[at + prefix.len()..];
        if let Some(group) = after.strip_prefix('{') {
            let group = &group[..group.find('}').unwrap_or(group.len())];
            names.extend(group.split(',').filter_map(|part| ident(part.trim())));
        } else if let Some(name) = ident(after) {
            names.push(name);
        }
    }
    names.retain(|n| n != "super" && n != "self");
    names
}

/// The identifier that starts `s`, if any.
fn ident(s: &str) -> Option<String> {
    let end = s
        .find(|c: char| !(c.is_alphanumeric() || c == '_'))
        .unwrap_or(s.len());
    (end > 0).then(|| s[..end].to_string())
}

fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for entry in std::fs::read_dir(&d).expect("source folder").flatten() {
            let p = entry.path();
            if p.is_dir() {
                todo.push(p);
            } else if p.extension().is_some_and(|e| e == "rs") {
                files.push(p);
            }
        }
    }
    files.sort();
    files
}

/// The graph of the modules under `src/<folder>` (the crate root when empty): a node per
/// direct child, except that each folder in `split` counts as its direct children.
fn module_graph(folder: &str, split: &[&str]) -> Graph {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let base = src.join(folder);
    let prefix = match folder {
        "" => "crate::".to_string(),
        f => format!("crate::{}::", f.replace('/', "::")),
    };
    let mut graph = Graph::new();
    for file in rust_files(&base) {
        let rel: Vec<String> = file
            .strip_prefix(&base)
            .expect("under base")
            .iter()
            .map(|c| c.to_string_lossy().trim_end_matches(".rs").to_string())
            .collect();
        let top = rel[0].clone();
        if matches!(top.as_str(), "lib" | "main" | "mod" | "cli" | "layering") {
            continue;
        }
        let split_here = split.contains(&top.as_str()) && rel.len() > 1 && rel[1] != "mod";
        let me = if split_here {
            format!("{top}::{}", rel[1])
        } else {
            top.clone()
        };
        let code = code_of(&std::fs::read_to_string(&file).expect("readable source"));
        let mut targets: Vec<String> = Vec::new();
        for name in names_after(&code, &prefix) {
            if split.contains(&name.as_str()) {
                // `crate::runtime::cpu::x` names the node `cpu::x`.
                let deeper = format!("{prefix}{name}::");
                let inner = names_after(&code, &deeper);
                targets.extend(inner.into_iter().map(|i| format!("{name}::{i}")));
                // `crate::runtime::cpu::CpuBackend`: the folder's re-export.
                targets.push(name.clone());
            } else {
                targets.push(name);
            }
        }
        if rel.len() == 1 && !folder.is_empty() {
            targets.extend(names_after(&code, "super::"));
        }
        if split.contains(&top.as_str()) && rel.len() == 2 && rel[1] == "mod" {
            // A device folder's re-exports (`pub use backend::CpuBackend;`) reach its files.
            for line in code.lines() {
                if let Some(path) = line.trim_start().strip_prefix("pub use ") {
                    targets.extend(ident(path).map(|n| format!("{top}::{n}")));
                }
            }
        }
        if split_here && rel.len() == 2 {
            targets.extend(
                names_after(&code, "super::")
                    .into_iter()
                    .map(|n| format!("{top}::{n}")),
            );
        }
        let edges = graph.entry(me.clone()).or_default();
        edges.extend(targets.into_iter().filter(|t| *t != me));
    }
    // Only references to modules that exist are edges (not `super::SomeType`), and a
    // folder's own re-exports are not a cycle with its files.
    let nodes: BTreeSet<String> = graph.keys().cloned().collect();
    for (me, edges) in graph.iter_mut() {
        let folder = me.split("::").next().unwrap_or(me).to_string();
        edges.retain(|t| nodes.contains(t) && !(me.contains("::") && *t == folder));
    }
    graph
}

/// A cycle of `graph` (its modules in order, the first repeated at the end), if any.
fn find_cycle(graph: &Graph) -> Option<Vec<String>> {
    #[derive(Clone, Copy, PartialEq)]
    enum Mark {
        Open,
        Done,
    }
    fn visit(
        node: &str,
        graph: &Graph,
        marks: &mut BTreeMap<String, Mark>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        match marks.get(node) {
            Some(Mark::Done) => return None,
            Some(Mark::Open) => {
                let start = path.iter().position(|n| n == node).unwrap_or(0);
                let mut cycle = path[start..].to_vec();
                cycle.push(node.to_string());
                return Some(cycle);
            }
            None => {}
        }
        marks.insert(node.to_string(), Mark::Open);
        path.push(node.to_string());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(c) = visit(next, graph, marks, path) {
                return Some(c);
            }
        }
        path.pop();
        marks.insert(node.to_string(), Mark::Done);
        None
    }
    let mut marks = BTreeMap::new();
    graph
        .keys()
        .find_map(|n| visit(n, graph, &mut marks, &mut Vec::new()))
}

fn assert_acyclic(what: &str, graph: &Graph) {
    assert!(graph.len() > 3, "{what}: found only {graph:?}");
    if let Some(cycle) = find_cycle(graph) {
        panic!(
            "{what}: module cycle {}. Move the shared piece below both modules (or the caller \
             above them) so references run one way.",
            cycle.join(" → ")
        );
    }
}

#[test]
fn top_level_modules_form_a_one_way_chain() {
    let graph = module_graph("", &[]);
    assert_acyclic("src/", &graph);
    // The compiler's chain, in order: no module reaches one to its left.
    let chain = [
        "ir", "frontend", "passes", "plan", "pipeline", "cost", "runtime",
    ];
    for (i, low) in chain.iter().enumerate() {
        for high in &chain[i + 1..] {
            assert!(
                !graph[*low].contains(*high),
                "src/{low} references src/{high}, a layer above it"
            );
        }
    }
}

#[test]
fn runtime_modules_have_no_cycle() {
    assert_acyclic("src/runtime/", &module_graph("runtime", &["cpu", "cuda"]));
}

#[test]
fn the_checks_see_a_cycle_and_references_of_every_shape() {
    let graph: Graph = [("a", "b"), ("b", "c"), ("c", "a"), ("d", "a")]
        .iter()
        .fold(Graph::new(), |mut g, (from, to)| {
            g.entry(from.to_string())
                .or_default()
                .insert(to.to_string());
            g.entry(to.to_string()).or_default();
            g
        });
    let cycle = find_cycle(&graph).expect("a cycle");
    assert_eq!(cycle.first(), cycle.last());
    assert_eq!(cycle.len(), 4, "{cycle:?}");
    let code = code_of(
        "use crate::plan::{Plan, verify};\nuse super::{backend::Backend, tensor};\n\
         // crate::cost in a comment\nfn f() { crate::runtime::x(); super::super::y(); }\n\
         #[cfg(test)]\nmod tests {\n    use crate::pipeline::z;\n}\nfn g() {}\n",
    );
    // A test module's references count like the code's.
    assert_eq!(
        names_after(&code, "crate::"),
        ["plan", "runtime", "pipeline"]
    );
    assert_eq!(names_after(&code, "super::"), ["backend", "tensor"]);
    assert!(code.contains("fn g()") && !code.contains("crate::cost"));
}
