//! `tpc ranks`: the JSON contract and the refusal of impossible layouts.

use std::process::Command;

fn tpc(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_tpc"))
        .args(args)
        .output()
        .expect("tpc runs")
}

#[test]
fn ranks_json_lists_every_group_kind_and_each_rank() {
    let o = tpc(&[
        "ranks", "--world", "16", "--tp", "2", "--pp", "2", "--dp", "2", "--json",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["ext_dp"], 2);
    assert_eq!(v["tp_groups"][0], serde_json::json!([0, 1]));
    assert_eq!(v["pp_groups"][0], serde_json::json!([0, 2]));
    assert_eq!(v["dp_groups"][0], serde_json::json!([0, 4]));
    assert_eq!(v["ep_groups"][0], serde_json::json!([0, 1, 4, 5]));
    assert_eq!(v["ranks"].as_array().unwrap().len(), 16);
    assert_eq!(
        v["ranks"][13],
        serde_json::json!({"rank": 13, "ext_dp": 1, "dp": 1, "pp": 0, "tp": 1})
    );
}

#[test]
fn a_world_that_does_not_divide_is_a_clear_error() {
    let o = tpc(&["ranks", "--world", "12", "--tp", "8"]);
    assert_eq!(o.status.code(), Some(1));
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        e.contains("multiple of it") && !e.contains("panicked"),
        "{e}"
    );
    let o = tpc(&["ranks", "--world", "8", "--dp", "0"]);
    assert_eq!(o.status.code(), Some(1));
}
