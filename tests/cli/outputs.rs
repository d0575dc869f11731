//! Output files as users point them (issue 35, items 9–12): through symbolic links, at
//! devices, over files with their own mode, into folders that take no file, beside the
//! leftovers of killed runs, and with names near the file system's limit.
//!
//! Devices are made in the test's own folder where this process may (`mknod`), so a tpc that
//! replaced a device by a file would replace that one, never the system's `/dev/null`.

use crate::cli::tpc;
use crate::scratch::Scratch;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const TINY: &str = "models/tiny-llama.ron";
const CHECKPOINT: &str = "tests/fixtures/checkpoints/llama-gqa";

fn scratch(test: &str) -> Scratch {
    Scratch::new("outputs", test)
}

fn ok(o: &Output) -> String {
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "expected success: {e}");
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Exit 1 with a message and no panic; returns stderr.
fn refused(o: &Output) -> String {
    let e = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(1), "expected a clean refusal: {e}");
    assert!(!e.contains("panicked"), "{e}");
    e
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A character device `major:minor` made in `dir`, or `None` where this process may not
/// make one (not root).
fn device_in(dir: &Path, name: &str, major: u32, minor: u32) -> Option<PathBuf> {
    let path = dir.join(name);
    let c = std::ffi::CString::new(s(&path)).unwrap();
    // SAFETY: a NUL-terminated path.
    let made = unsafe {
        libc::mknod(
            c.as_ptr(),
            libc::S_IFCHR | 0o666,
            libc::makedev(major, minor),
        )
    };
    (made == 0).then_some(path)
}

fn is_char_device(p: &Path) -> bool {
    std::fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_char_device())
}

#[test]
fn o_onto_a_symlink_writes_the_file_it_names_and_keeps_the_link() {
    let dir = scratch("link");
    std::fs::create_dir(dir.join("plans")).unwrap();
    let real = dir.join("plans/tiny.ron");
    std::fs::write(&real, "stale").unwrap();
    let link = dir.join("current.ron");
    std::os::unix::fs::symlink("plans/tiny.ron", &link).unwrap();
    ok(&tpc(&["compile", TINY, "--tp", "2", "-o", s(&link)]));
    assert!(
        std::fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink(),
        "the link was replaced by a file"
    );
    let plan = std::fs::read_to_string(&real).unwrap();
    assert!(
        plan.contains("version:"),
        "the file the link names is stale"
    );
    // Nothing else appeared beside either.
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 2);
    assert_eq!(std::fs::read_dir(dir.join("plans")).unwrap().count(), 1);
}

#[test]
fn o_onto_a_character_device_writes_it_and_leaves_it_a_device() {
    let dir = scratch("device");
    let Some(null) = device_in(&dir, "null", 1, 3) else {
        println!("NOT RUN: this process may not make devices (not root)");
        return;
    };
    for args in [
        &[
            "compile",
            TINY,
            "--tp",
            "2",
            "-o",
            s(&null),
            "--dot",
            s(&null),
        ][..],
        &["dot", TINY, "-o", s(&null)],
        &["lower", TINY, "-o", s(&null)],
        &[
            "run",
            CHECKPOINT,
            "--prompt-ids",
            "1,2",
            "--max-new-tokens",
            "2",
            "--dump-logits",
            s(&null),
        ],
    ] {
        ok(&tpc(args));
        assert!(is_char_device(&null), "{args:?} replaced the device");
    }
    // Only now the system's /dev/null: the same code path, proven harmless just above.
    ok(&tpc(&["compile", TINY, "--tp", "2", "-o", "/dev/null"]));
    assert!(is_char_device(Path::new("/dev/null")));
    // A device the bytes cannot go to is an error, and stays a device.
    let full = device_in(&dir, "full", 1, 7).unwrap();
    let e = refused(&tpc(&["compile", TINY, "-o", s(&full)]));
    assert!(e.contains("No space left"), "{e}");
    assert!(is_char_device(&full));
}

#[test]
fn o_onto_stdouts_proc_link_writes_stdout() {
    if !Path::new("/proc/self/fd").is_dir() {
        println!("NOT RUN: no /proc");
        return;
    }
    // `/proc/self/fd/1` (what `/dev/stdout` leads to) names "pipe:[…]": it must be opened,
    // not resolved and replaced.
    let out = ok(&tpc(&["lower", TINY, "-o", "/proc/self/fd/1"]));
    assert!(!out.is_empty(), "nothing reached stdout");
}

#[test]
fn a_replaced_output_keeps_its_mode() {
    let dir = scratch("mode");
    let plan = dir.join("p.ron");
    std::fs::write(&plan, "old").unwrap();
    std::fs::set_permissions(&plan, std::fs::Permissions::from_mode(0o600)).unwrap();
    ok(&tpc(&["compile", TINY, "--tp", "2", "-o", s(&plan)]));
    let meta = std::fs::metadata(&plan).unwrap();
    assert_eq!(meta.mode() & 0o777, 0o600, "mode {:o}", meta.mode());
    assert!(std::fs::read_to_string(&plan).unwrap().contains("version:"));
}

/// Runs tpc with `args` where `folder` is read-only (a read-only bind mount in a private
/// mount namespace), or `None` where this system cannot make one.
fn in_read_only_folder(folder: &Path, args: &[&str]) -> Option<Output> {
    let o = Command::new("unshare")
        .args([
            "-rm",
            "sh",
            "-c",
            r#"mount --bind -o ro "$1" "$1" && shift && exec "$@""#,
        ])
        .args(["sh", s(folder), env!("CARGO_BIN_EXE_tpc")])
        .args(args)
        .output()
        .ok()?;
    let e = String::from_utf8_lossy(&o.stderr);
    (!e.contains("unshare:") && !e.contains("mount:")).then_some(o)
}

#[test]
fn dump_logits_into_a_folder_that_takes_no_file_fails_before_the_run() {
    let dir = scratch("readonly");
    let ro = dir.join("ro");
    std::fs::create_dir(&ro).unwrap();
    // A checkpoint whose weights are cut short: loading it fails, so a refusal that names
    // --dump-logits came before the load.
    let broken = dir.join("ck");
    std::fs::create_dir(&broken).unwrap();
    std::fs::copy(
        Path::new(CHECKPOINT).join("config.json"),
        broken.join("config.json"),
    )
    .unwrap();
    let weights = std::fs::read(Path::new(CHECKPOINT).join("model.safetensors")).unwrap();
    std::fs::write(
        broken.join("model.safetensors"),
        &weights[..weights.len() / 2],
    )
    .unwrap();
    let mut tried = 0;
    for model in [Path::new(CHECKPOINT), &broken] {
        let logits = ro.join("logits.safetensors");
        let args = [
            "run",
            s(model),
            "--prompt-ids",
            "1,2",
            "--max-new-tokens",
            "2",
            "--dump-logits",
            s(&logits),
        ];
        let mut outcomes = Vec::new();
        outcomes.extend(in_read_only_folder(&ro, &args));
        // Not even root may create files in sysfs.
        if Path::new("/sys/kernel").is_dir() {
            let mut args = args;
            args[7] = "/sys/tpc-logits.safetensors";
            outcomes.push(tpc(&args));
        }
        for o in outcomes {
            tried += 1;
            let e = refused(&o);
            assert!(
                e.contains("--dump-logits") && e.contains("cannot be created in its folder"),
                "{e}"
            );
            assert!(o.stdout.is_empty(), "the run went ahead");
        }
    }
    assert!(tried > 0, "no read-only folder could be made here");
}

#[test]
fn a_disk_without_room_for_the_logits_fails_before_the_run() {
    let dir = scratch("room");
    let logits = dir.join("l.safetensors");
    // A file size limit of 1 KiB (512 B in some shells) stands in for a full disk: the
    // logits of 8 tokens over the vocabulary take more.
    let o = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "trap '' XFSZ; ulimit -f 1 && exec {} run {CHECKPOINT} --prompt-ids 1,2,3,4,5,6,7,8 --max-new-tokens 2 --dump-logits {}",
            env!("CARGO_BIN_EXE_tpc"),
            s(&logits)
        ))
        .output()
        .unwrap();
    let e = refused(&o);
    assert!(e.contains("--dump-logits") && e.contains("no room"), "{e}");
    assert!(o.stdout.is_empty(), "the run went ahead");
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
}

#[test]
fn a_late_write_failure_still_prints_the_tokens() {
    let dir = scratch("late");
    let Some(full) = device_in(&dir, "full", 1, 7) else {
        println!("NOT RUN: this process may not make devices (not root)");
        return;
    };
    let run = |extra: &[&str]| {
        let mut args = vec![
            "run",
            CHECKPOINT,
            "--prompt-ids",
            "1,2",
            "--max-new-tokens",
            "3",
        ];
        args.extend_from_slice(extra);
        tpc(&args)
    };
    let tokens = ok(&run(&[]));
    let o = run(&["--dump-logits", s(&full)]);
    let e = refused(&o);
    assert!(e.contains("No space left"), "{e}");
    assert_eq!(String::from_utf8_lossy(&o.stdout), tokens);
    assert!(is_char_device(&full));
}

/// FNV-1a of a target's file name: the tag its temporaries carry (`.tpc-TAG-PID-N.tmp`).
fn tag(name: &str) -> String {
    let h = name.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    format!("{h:016x}")
}

#[test]
fn temporaries_of_killed_runs_are_removed_by_the_next_write() {
    let dir = scratch("stale");
    // A process that has exited: its pid is free.
    let mut child = Command::new("true").spawn().unwrap();
    let dead = child.id();
    child.wait().unwrap();
    let name = "logits.safetensors";
    let stale = [
        format!(".tpc-{}-{dead}-0.tmp", tag(name)),
        // What earlier versions of tpc left.
        format!(".{name}.tpc-{dead}-0.tmp"),
    ];
    // Pid 1 always runs: its temporary may be in use.
    let live = format!(".tpc-{}-1-0.tmp", tag(name));
    for n in stale.iter().chain([&live]) {
        std::fs::write(dir.join(n), vec![0u8; 1 << 20]).unwrap();
    }
    ok(&tpc(&[
        "run",
        CHECKPOINT,
        "--prompt-ids",
        "1,2",
        "--max-new-tokens",
        "2",
        "--dump-logits",
        s(&dir.join(name)),
    ]));
    let mut left: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    let mut expected = vec![live, name.to_string()];
    expected.sort();
    assert_eq!(left, expected);
}

#[test]
fn an_output_name_near_the_file_system_limit_works() {
    let dir = scratch("long");
    // 255 bytes is the usual limit of one name.
    let name = format!("{}.ron", "p".repeat(250));
    let plan = dir.join(&name);
    ok(&tpc(&["compile", TINY, "--tp", "2", "-o", s(&plan)]));
    ok(&tpc(&["compile", TINY, "--tp", "2", "-o", s(&plan)]));
    assert!(std::fs::read_to_string(&plan).unwrap().contains("version:"));
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
}
