//! `mpirun -np W tpc serve …`: one server whose ranks are MPI processes, driven over HTTP.
//! Many requests at once get exactly the greedy tokens each gets alone — at tp 2, with
//! pipeline stages, with prompts prefilled in chunks, with a pool so small that requests are
//! preempted, with replicas (`--dp`) in processes of their own behind the one front — the
//! reference prompt gets HF's tokens, and SIGTERM to the leading process drains the server:
//! every process exits 0. (SIGTERM to Open MPI's `mpirun` itself ends the
//! job with status 1 whatever the processes do.)

use super::serve_client::{requests, Server};
use super::{mpirun, read_reference, HANG};
use crate::common::fixture;
use std::process::Command;

/// `mpirun -np NP tpc serve MODEL ARGS` on a free port, one compute thread per rank.
fn start(np: usize, model: &str, args: &[&str]) -> Server {
    let mut c = mpirun(np);
    c.args(["serve", model, "--port", "0", "--host", "127.0.0.1"])
        .args(["--threads-per-rank", "1"])
        .args(args);
    Server::start(c, &format!("`mpirun -np {np} tpc serve {args:?}`"))
}

/// A squeezed pool for llama-gqa: 12 blocks of 4 tokens at 128 bytes a token (keys and
/// values in f32, 8 dims: at tp 2, 2 layers of 1 kv head a rank; at pp 2, 1 layer of 2 kv
/// heads a stage). The longest request (46 tokens) fits, the requests an engine gets at
/// once do not.
fn squeezed_pool() -> String {
    let per_token = 2 * 2 * 8 * 4;
    (per_token * 4 * 12).to_string()
}

/// Serves llama-gqa under each config (what, -np, flags): ten requests alone and all at
/// once get the same tokens, the reference prompt HF's (a squeezed pool must preempt);
/// with `replicas`, every replica ran some; SIGTERM to the leading process drains the
/// server and every process exits 0.
fn check_configs(configs: &[(&str, usize, Vec<&str>)], replicas: usize) {
    let dir = fixture("llama-gqa");
    let model = dir.to_str().unwrap();
    let reference = read_reference(&dir);
    let reqs = requests(&reference.prompt, reference.greedy.len(), 9);
    for (what, np, args) in configs {
        let server = start(*np, model, args);
        assert!(
            server.line.contains(&format!("dp={replicas}")),
            "{what}: {}",
            server.line
        );
        server.check_alone_and_at_once(&reqs, &reference.greedy, what.contains("squeezed"), what);
        if replicas > 1 {
            server.check_every_replica_served(replicas, what);
        }
        server.drain_from_leading(HANG, what);
        eprintln!("{what}: {} requests alone and at once agree", reqs.len());
    }
}

#[test]
fn a_server_of_mpi_processes_gives_every_request_its_solo_greedy_tokens() {
    let squeezed = squeezed_pool();
    check_configs(
        &[
            ("tp 2", 2, vec!["--tp", "2"]),
            (
                "tp 2, pp 2, chunked prefill",
                4,
                vec!["--tp", "2", "--pp", "2", "--block-size", "4"]
                    .into_iter()
                    .chain(["--max-num-batched-tokens", "3"])
                    .collect(),
            ),
            (
                "tp 2, squeezed pool",
                2,
                vec!["--tp", "2", "--block-size", "4", "--no-prefix-caching"]
                    .into_iter()
                    .chain(["--kv-cache-memory", &squeezed])
                    .chain(["--max-num-batched-tokens", "16"])
                    .collect(),
            ),
        ],
        1,
    );
}

/// Replicas as processes behind one front: each replica's engine runs requests (the front
/// sends each to the least loaded), their tokens are the same as alone and HF's, /metrics
/// lists every replica, and SIGTERM to the front drains them all.
#[test]
fn replicas_as_processes_serve_behind_one_front() {
    let squeezed = squeezed_pool();
    check_configs(
        &[
            ("dp 2", 2, vec!["--dp", "2"]),
            ("tp 2, dp 2", 4, vec!["--tp", "2", "--dp", "2"]),
            (
                "pp 2, dp 2, squeezed pool",
                4,
                vec!["--pp", "2", "--dp", "2", "--block-size", "4"]
                    .into_iter()
                    .chain(["--no-prefix-caching", "--kv-cache-memory", &squeezed])
                    .chain(["--max-num-batched-tokens", "16"])
                    .collect(),
            ),
        ],
        2,
    );
}

/// `--dp 2 --ep` with the replicas as processes: each tp rank's experts are dealt over the
/// two replicas, whose leading processes tick together so that a replica without a request
/// answers the other's calls. Every MoE fixture, requests one at a time (one replica
/// working, the other answering) and all at once (both working), gets the tokens a server
/// of threads gives at `--dp 1`, and HF's for HF's prompt; at tp 2 and with pipeline
/// stages too (one fixture each); both replicas serve, and SIGTERM drains them.
#[test]
fn moe_replicas_as_processes_sharing_experts_give_their_dp_1_tokens() {
    let mut cases: Vec<(&str, usize, Vec<&str>)> = crate::common::MOE_FIXTURES
        .iter()
        .map(|&name| (name, 2, vec![]))
        .collect();
    cases.push(("qwen3-moe", 4, vec!["--tp", "2"]));
    cases.push(("mixtral-moe", 4, vec!["--pp", "2"]));
    for (name, np, layout) in cases {
        let dir = fixture(name);
        let model = dir.to_str().unwrap();
        let reference = read_reference(&dir);
        let reqs = requests(&reference.prompt, reference.greedy.len(), 5);
        let mut common = vec!["--moe", "expert"];
        common.extend(&layout);
        let alone: Vec<Vec<i64>> = {
            let mut c = std::process::Command::new(super::TPC);
            c.args(["serve", model, "--port", "0", "--launcher", "threads"])
                .args(&common);
            let server = Server::start(c, &format!("{name} {common:?} as threads"));
            reqs.iter().map(|(p, n)| server.complete(p, *n)).collect()
        };
        assert_eq!(
            alone[0], reference.greedy,
            "{name} {layout:?} --dp 1: not HF's tokens"
        );
        let mut args = common.clone();
        args.extend(["--dp", "2", "--ep"]);
        let what = format!("{name} {args:?} under mpirun -np {np}");
        let server = start(np, model, &args);
        assert!(server.line.contains("ep="), "{what}: {}", server.line);
        let one_at_a_time: Vec<Vec<i64>> =
            reqs.iter().map(|(p, n)| server.complete(p, *n)).collect();
        assert_eq!(one_at_a_time, alone, "{what}, one at a time");
        let together = server.complete_all_at_once(&reqs);
        assert_eq!(together, alone, "{what}, all at once");
        server.check_every_replica_served(2, &what);
        server.drain_from_leading(HANG, &what);
        eprintln!("{what}: {} requests agree with --dp 1", reqs.len());
    }
}

/// A replica's leading process killed while the front serves: mpirun ends the whole job
/// (no process waits on the dead one: not the front's relay, not the other replica's
/// engine), and says which rank died.
#[test]
fn a_replica_process_killed_ends_the_server() {
    let dir = fixture("llama-gqa");
    let server = start(2, dir.to_str().unwrap(), &["--dp", "2"]);
    assert_eq!(server.complete(&[1, 2, 3], 4).len(), 4);
    let ranks = super::ranks_of(server.pid());
    let victim = ranks
        .iter()
        .find(|(_, r)| *r == 1)
        .unwrap_or_else(|| panic!("no world rank 1 among {ranks:?}"))
        .0;
    let killed = Command::new("kill")
        .args(["-9", &victim.to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let (status, said) = server.wait_exit(HANG);
    assert!(
        !status.success(),
        "the server exited 0 after a replica was killed:\n{said}"
    );
    assert!(
        said.contains("rank 1") && said.contains("signal 9"),
        "mpirun does not name rank 1 and SIGKILL:\n{said}"
    );
}

#[test]
fn a_server_under_mpirun_refuses_a_wrong_process_count() {
    let dir = fixture("llama-gqa");
    let model = dir.to_str().unwrap();
    for (np, args, says) in [
        (
            4usize,
            vec!["--tp", "2"],
            "1 replica(s) of tp · pp = 2 ranks take 2 processes",
        ),
        (
            2,
            vec!["--tp", "2", "--dp", "2"],
            "2 replica(s) of tp · pp = 2 ranks take 4 processes",
        ),
    ] {
        let mut c = mpirun(np);
        c.args(["serve", model, "--port", "0"]).args(&args);
        let out = super::run(c, "serve refused");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} under -np {np} was served");
        assert!(err.contains(says), "{args:?} -np {np}: {err}");
    }
}
