//! What the ranks of one MPI job must agree on before they load anything: the command,
//! the options that change what they compute or which collectives they call, the plan, and
//! the model files. Each MPI process parses its own command line, so ranks started with
//! different arguments or given different files would otherwise run to wrong tokens, or
//! call collectives of different sizes (`MPI_ERR_TRUNCATE`), or wait on each other forever.
//!
//! Each rank writes a [`Record`] of named fields; the ranks exchange them
//! (`processes::MpiWorld::all_gather_bytes`, their first collective, sizes first so no
//! record can be truncated) and every rank runs [`verdict`] over all of them, so every rank
//! reaches the same verdict and names the same fields and ranks. Bulky values (the prompt,
//! the plan, the weight files) travel as stable 64-bit digests, short ones as text so the
//! message can show them.

use serde::{Deserialize, Serialize};

/// FNV-1a over 64 bits: the same bytes give the same value in every build and on every host
/// (std's `DefaultHasher` promises neither). Not a defence against a forger, only a way to
/// tell honest differences apart.
#[derive(Debug, Clone, Copy)]
pub struct Digest(u64);

impl Default for Digest {
    fn default() -> Digest {
        Digest(0xcbf2_9ce4_8422_2325)
    }
}

impl Digest {
    pub fn bytes(&mut self, bytes: &[u8]) -> &mut Digest {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
        self
    }

    /// A length and then the bytes, so that `("ab", "c")` and `("a", "bc")` differ.
    pub fn part(&mut self, bytes: &[u8]) -> &mut Digest {
        self.bytes(&(bytes.len() as u64).to_le_bytes()).bytes(bytes)
    }

    pub fn u64(&mut self, v: u64) -> &mut Digest {
        self.bytes(&v.to_le_bytes())
    }

    pub fn finish(&self) -> u64 {
        self.0
    }
}

/// The digest of `bytes`.
pub fn digest(bytes: &[u8]) -> u64 {
    Digest::default().bytes(bytes).finish()
}

/// What a field names, which decides what the message advises.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Kind {
    /// The tpc build and the command: when these differ nothing else is comparable.
    Job,
    /// A command-line option, named as it is spelled (`--seed`).
    Argument,
    /// A model file, named by its path in the model folder.
    File,
    /// Something that follows from the arguments and files (the plan, the stop ids):
    /// named only when no argument or file explains the difference.
    Derived,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
enum Value {
    Shown(String),
    Digest(u64),
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Field {
    name: String,
    kind: Kind,
    value: Value,
}

/// Values longer than this travel as digests (the message then says "one value").
const SHOWN_MAX: usize = 48;

/// What one rank is about to run, field by field.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Record {
    fields: Vec<Field>,
}

/// Changes whenever a record's fields change meaning, so that ranks of different tpc
/// builds are told apart before their other fields are compared.
const RECORD_FORMAT: u32 = 1;

impl Record {
    /// A record of `command` (`run`, `bench`, …) by this tpc.
    pub fn new(command: &str) -> Record {
        let mut r = Record::default();
        r.push(
            "the tpc build",
            Kind::Job,
            Value::Shown(format!(
                "tpc {} (record format {RECORD_FORMAT})",
                env!("CARGO_PKG_VERSION")
            )),
        );
        r.push("the command", Kind::Job, shown_or_digest(command));
        r
    }

    fn push(&mut self, name: &str, kind: Kind, value: Value) {
        self.fields.push(Field {
            name: name.to_string(),
            kind,
            value,
        });
    }

    /// An option's effective value, shown in the message when short.
    pub fn argument(&mut self, name: &str, value: impl std::fmt::Display) -> &mut Record {
        self.push(name, Kind::Argument, shown_or_digest(&value.to_string()));
        self
    }

    /// An option's value by its digest (a prompt, a file of prompts).
    pub fn argument_digest(&mut self, name: &str, digest: u64) -> &mut Record {
        self.push(name, Kind::Argument, Value::Digest(digest));
        self
    }

    /// A model file by the digest of what identifies it; `None`: the rank has no such file.
    pub fn file(&mut self, name: &str, digest: Option<u64>) -> &mut Record {
        let value = digest.map_or_else(|| Value::Shown("none".into()), Value::Digest);
        self.push(name, Kind::File, value);
        self
    }

    /// A value that follows from the arguments and files, by its digest.
    pub fn derived_digest(&mut self, name: &str, digest: u64) -> &mut Record {
        self.push(name, Kind::Derived, Value::Digest(digest));
        self
    }

    /// A value that follows from the arguments and files, shown when short.
    pub fn derived(&mut self, name: &str, value: impl std::fmt::Display) -> &mut Record {
        self.push(name, Kind::Derived, shown_or_digest(&value.to_string()));
        self
    }

    /// The record as it travels to the other ranks.
    pub fn to_bytes(&self) -> Vec<u8> {
        // A struct of strings and integers always serializes.
        serde_json::to_vec(self).unwrap_or_default()
    }
}

fn shown_or_digest(text: &str) -> Value {
    if text.chars().count() <= SHOWN_MAX {
        Value::Shown(text.to_string())
    } else {
        Value::Digest(digest(text.as_bytes()))
    }
}

/// The ranks' records differ (or one does not read): the message names each differing
/// field and which ranks hold which value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Disagreement(pub String);

/// Compares every rank's record (`records[r]` from world rank `r`): `Ok` when all are
/// equal. Every rank calls it with the same records, so every rank returns the same
/// verdict.
pub fn verdict(records: &[Vec<u8>]) -> Result<(), Disagreement> {
    let mut parsed = Vec::with_capacity(records.len());
    let mut unreadable = Vec::new();
    for (rank, bytes) in records.iter().enumerate() {
        match serde_json::from_slice::<Record>(bytes) {
            Ok(r) => parsed.push(r),
            Err(_) => unreadable.push(rank),
        }
    }
    if !unreadable.is_empty() {
        return Err(Disagreement(format!(
            "MPI ranks disagree on the tpc build: {} sent a record this tpc cannot read; start every rank with the same tpc",
            ranks_phrase(&unreadable),
        )));
    }
    // Job fields first: a rank running another command has other fields altogether.
    for kinds in [
        &[Kind::Job][..],
        &[Kind::Argument, Kind::File],
        &[Kind::Derived],
    ] {
        let clauses = differing(&parsed, kinds);
        if clauses.is_empty() {
            continue;
        }
        let advice = advice(clauses.iter().map(|(kind, _)| *kind));
        let text: Vec<String> = clauses.into_iter().map(|(_, c)| c).collect();
        return Err(Disagreement(format!(
            "MPI ranks disagree on {}; {advice}",
            text.join("; on ")
        )));
    }
    Ok(())
}

/// "rank 3", "ranks 0,2", "ranks 0-5,7": runs of consecutive ranks as ranges.
fn ranks_phrase(ranks: &[usize]) -> String {
    let mut runs: Vec<String> = Vec::new();
    let mut i = 0;
    while i < ranks.len() {
        let mut j = i;
        while j + 1 < ranks.len() && ranks[j + 1] == ranks[j] + 1 {
            j += 1;
        }
        runs.push(match j - i {
            0 => ranks[i].to_string(),
            1 => format!("{},{}", ranks[i], ranks[j]),
            _ => format!("{}-{}", ranks[i], ranks[j]),
        });
        i = j + 1;
    }
    let word = if ranks.len() == 1 { "rank" } else { "ranks" };
    format!("{word} {}", runs.join(","))
}

/// The names of the fields of `kinds`, in order of first appearance over the ranks.
fn names(records: &[Record], kinds: &[Kind]) -> Vec<(String, Kind)> {
    let mut out: Vec<(String, Kind)> = Vec::new();
    for r in records {
        for f in &r.fields {
            if kinds.contains(&f.kind) && !out.iter().any(|(n, _)| *n == f.name) {
                out.push((f.name.clone(), f.kind));
            }
        }
    }
    out
}

/// One clause per field of `kinds` whose value is not the same on every rank.
fn differing(records: &[Record], kinds: &[Kind]) -> Vec<(Kind, String)> {
    let mut clauses = Vec::new();
    for (name, kind) in names(records, kinds) {
        let values: Vec<Option<&Value>> = records
            .iter()
            .map(|r| r.fields.iter().find(|f| f.name == name).map(|f| &f.value))
            .collect();
        // Ranks grouped by value, groups in the order of their first rank.
        let mut groups: Vec<(Option<&Value>, Vec<usize>)> = Vec::new();
        for (rank, v) in values.iter().enumerate() {
            match groups.iter_mut().find(|(g, _)| g == v) {
                Some((_, ranks)) => ranks.push(rank),
                None => groups.push((*v, vec![rank])),
            }
        }
        if groups.len() < 2 {
            continue;
        }
        let what = if kind == Kind::File {
            "the model file "
        } else {
            ""
        };
        let mut digests_seen = 0;
        let parts: Vec<String> = groups
            .iter()
            .map(|(value, ranks)| {
                let has = if ranks.len() == 1 { "has" } else { "have" };
                let value = match value {
                    Some(Value::Shown(s)) => s.clone(),
                    Some(Value::Digest(_)) => {
                        digests_seen += 1;
                        let thing = if kind == Kind::File {
                            "version"
                        } else {
                            "value"
                        };
                        if digests_seen == 1 {
                            format!("one {thing}")
                        } else {
                            format!("another {thing}")
                        }
                    }
                    None if kind == Kind::File => "none".into(),
                    None => "no such field (another tpc build?)".into(),
                };
                format!("{} {has} {value}", ranks_phrase(ranks))
            })
            .collect();
        clauses.push((kind, format!("{what}{name}: {}", parts.join(", "))));
    }
    clauses
}

/// What to do about the differences of these kinds.
fn advice(kinds: impl Iterator<Item = Kind>) -> &'static str {
    let (mut job, mut args, mut files, mut derived) = (false, false, false, false);
    for k in kinds {
        match k {
            Kind::Job => job = true,
            Kind::Argument => args = true,
            Kind::File => files = true,
            Kind::Derived => derived = true,
        }
    }
    match (job, args, files, derived) {
        (true, ..) => "start every rank with the same tpc and the same command",
        (_, true, false, _) => "start every rank with the same arguments",
        (_, false, true, _) => {
            "give every rank the same model files (copy the folder, or share one)"
        }
        _ => "start every rank with the same arguments and the same model files",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_record(seed: u64, tp: u64) -> Record {
        let mut r = Record::new("run");
        r.argument("--tp", tp).argument("--seed", seed);
        r.derived_digest("the plan", tp);
        r
    }

    fn verdict_of(records: &[Record]) -> Result<(), Disagreement> {
        let bytes: Vec<Vec<u8>> = records.iter().map(Record::to_bytes).collect();
        verdict(&bytes)
    }

    #[test]
    fn fnv_1a_matches_its_published_values() {
        // Test vectors of the FNV-1a 64-bit reference.
        assert_eq!(digest(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(digest(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(digest(b"foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn equal_records_agree() {
        assert_eq!(
            verdict_of(&[run_record(1, 2), run_record(1, 2), run_record(1, 2)]),
            Ok(())
        );
    }

    #[test]
    fn a_differing_option_names_itself_and_the_ranks() {
        let e = verdict_of(&[run_record(1, 2), run_record(2, 2), run_record(1, 2)]).unwrap_err();
        assert_eq!(
            e.0,
            "MPI ranks disagree on --seed: ranks 0,2 have 1, rank 1 has 2; start every rank with the same arguments"
        );
    }

    #[test]
    fn a_plan_that_follows_from_a_differing_option_is_not_named() {
        let e = verdict_of(&[run_record(1, 2), run_record(1, 1)]).unwrap_err();
        assert!(e.0.contains("--tp: rank 0 has 2, rank 1 has 1"), "{e}");
        assert!(!e.0.contains("plan"), "{e}");
    }

    #[test]
    fn a_differing_plan_alone_is_named() {
        let mut other = run_record(1, 2);
        other.fields[4].value = Value::Digest(99);
        let e = verdict_of(&[run_record(1, 2), other]).unwrap_err();
        assert!(
            e.0.contains("the plan: rank 0 has one value, rank 1 has another value"),
            "{e}"
        );
    }

    #[test]
    fn another_command_is_named_before_its_other_fields() {
        let mut bench = Record::new("bench");
        bench.argument("--batch", 4);
        let e = verdict_of(&[run_record(1, 2), bench]).unwrap_err();
        assert_eq!(
            e.0,
            "MPI ranks disagree on the command: rank 0 has run, rank 1 has bench; start every rank with the same tpc and the same command"
        );
    }

    #[test]
    fn files_are_named_and_ranks_grouped_into_ranges() {
        let record = |d: Option<u64>| {
            let mut r = Record::new("run");
            r.file("model.safetensors", d);
            r
        };
        let mut records: Vec<Record> = (0..6).map(|_| record(Some(1))).collect();
        records[4] = record(Some(2));
        records.push(record(None));
        let e = verdict_of(&records).unwrap_err();
        assert_eq!(
            e.0,
            "MPI ranks disagree on the model file model.safetensors: ranks 0-3,5 have one version, rank 4 has another version, rank 6 has none; give every rank the same model files (copy the folder, or share one)"
        );
    }

    #[test]
    fn an_unreadable_record_names_its_rank() {
        let e = verdict(&[run_record(1, 2).to_bytes(), b"\x00garbage".to_vec()]).unwrap_err();
        assert!(e.0.contains("tpc build: rank 1 sent a record"), "{e}");
    }

    #[test]
    fn long_values_travel_as_digests() {
        let mut a = Record::new("run");
        a.argument("--x", "y".repeat(SHOWN_MAX + 1));
        let mut b = Record::new("run");
        b.argument("--x", "z".repeat(SHOWN_MAX + 1));
        let e = verdict_of(&[a, b]).unwrap_err();
        assert!(
            e.0.contains("--x: rank 0 has one value, rank 1 has another value"),
            "{e}"
        );
    }
}
