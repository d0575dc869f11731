//! Byte-level mutations for text and binary inputs: flips, range edits, splices between
//! seeds, interesting numbers, dictionary tokens, deep nesting and truncation.

use super::rng::Rng;

/// Numbers that tend to break size arithmetic, float handling and integer parsing.
pub const INTERESTING_NUMBERS: &[&str] = &[
    "0",
    "1",
    "-1",
    "2",
    "3",
    "7",
    "255",
    "65536",
    "2147483647",
    "2147483648",
    "4294967295",
    "4294967296",
    "9223372036854775807",
    "9223372036854775808",
    "18446744073709551615",
    "18446744073709551616",
    "4611686018427387904",
    "10000000",
    "1000000000",
    "-9223372036854775808",
    "1e308",
    "-1e308",
    "1e-320",
    "1e400",
    "NaN",
    "inf",
    "-inf",
    "-0.0",
    "0.0",
    "0.5",
    "123456789012345678901234567890123456789012345678901234567890",
];

/// Bytes worth writing over others: delimiters, quotes, escapes, a stray UTF-8 lead byte.
const INTERESTING_BYTES: &[u8] = b"\0\xff\x80\"'\\()[]{},:;.-+eE0 \n";

/// One mutated copy of `input`; `others` are the kind's seeds for splicing, `dict` its
/// tokens (field names, variants, flags). The result is at most `max_len` bytes.
pub fn mutate(
    rng: &mut Rng,
    input: &[u8],
    others: &[Vec<u8>],
    dict: &[&str],
    max_len: usize,
) -> Vec<u8> {
    let mut out = input.to_vec();
    // Mostly one edit, sometimes a stack of several (havoc).
    let edits = if rng.one_in(3) { rng.range(2, 8) } else { 1 };
    for _ in 0..edits {
        edit(rng, &mut out, others, dict);
    }
    out.truncate(max_len);
    out
}

fn edit(rng: &mut Rng, out: &mut Vec<u8>, others: &[Vec<u8>], dict: &[&str]) {
    let len = out.len();
    match rng.below(12) {
        0 if len > 0 => {
            let i = rng.below(len);
            out[i] ^= 1 << rng.below(8);
        }
        1 if len > 0 => {
            let i = rng.below(len);
            out[i] = *rng.pick(INTERESTING_BYTES);
        }
        2 => {
            let at = rng.below(len + 1);
            let n = rng.range(1, 8);
            let bytes: Vec<u8> = (0..n).map(|_| rng.next_u64() as u8).collect();
            out.splice(at..at, bytes);
        }
        3 if len > 0 => {
            let (a, b) = span(rng, len);
            out.drain(a..b);
        }
        4 if len > 0 => {
            // Duplicate a range somewhere else: repeated fields, layers, entries.
            let (a, b) = span(rng, len);
            let chunk = out[a..b].to_vec();
            let at = rng.below(len + 1);
            out.splice(at..at, chunk);
        }
        5 if !others.is_empty() => {
            let other = &others[rng.below(others.len())];
            splice(rng, out, other);
        }
        6 | 7 => replace_number(rng, out),
        8 if !dict.is_empty() => {
            let token = rng.pick(dict).as_bytes().to_vec();
            let at = rng.below(len + 1);
            if rng.one_in(2) {
                out.splice(at..at, token);
            } else {
                let end = word_end(out, at);
                out.splice(at..end, token);
            }
        }
        9 => nest(rng, out),
        10 if len > 0 => out.truncate(rng.below(len)),
        _ => replace_number(rng, out),
    }
}

/// A random range `a..b` of `0..len`, usually short.
fn span(rng: &mut Rng, len: usize) -> (usize, usize) {
    let a = rng.below(len);
    let max = if rng.one_in(8) {
        len - a
    } else {
        32.min(len - a)
    };
    (a, a + rng.range(1, max.max(1)).min(len - a))
}

/// Either a prefix of `out` joined to a suffix of `other`, or a chunk of `other`
/// inserted into `out`.
fn splice(rng: &mut Rng, out: &mut Vec<u8>, other: &[u8]) {
    if other.is_empty() {
        return;
    }
    if rng.one_in(2) {
        let cut = rng.below(out.len() + 1);
        out.truncate(cut);
        out.extend_from_slice(&other[rng.below(other.len())..]);
    } else {
        let (a, b) = span(rng, other.len());
        let at = rng.below(out.len() + 1);
        out.splice(at..at, other[a..b].iter().copied());
    }
}

fn is_number_byte(b: u8) -> bool {
    b.is_ascii_digit() || matches!(b, b'.' | b'e' | b'E' | b'-' | b'+')
}

/// Replaces one number of the text (a digit run with its sign, point and exponent) by an
/// interesting value; inserts one when there is none.
fn replace_number(rng: &mut Rng, out: &mut Vec<u8>) {
    let starts: Vec<usize> = (0..out.len())
        .filter(|&i| {
            out[i].is_ascii_digit()
                && (i == 0 || !(out[i - 1].is_ascii_alphanumeric() || out[i - 1] == b'_'))
        })
        .collect();
    let value = rng.pick(INTERESTING_NUMBERS).as_bytes().to_vec();
    if starts.is_empty() {
        let at = rng.below(out.len() + 1);
        out.splice(at..at, value);
        return;
    }
    let mut a = *rng.pick(&starts);
    if a > 0 && out[a - 1] == b'-' {
        a -= 1;
    }
    let mut b = a + 1;
    while b < out.len() && is_number_byte(out[b]) {
        b += 1;
    }
    out.splice(a..b, value);
}

/// Where the identifier or number at `at` ends.
fn word_end(out: &[u8], at: usize) -> usize {
    let mut end = at;
    while end < out.len() && (out[end].is_ascii_alphanumeric() || out[end] == b'_') {
        end += 1;
    }
    end
}

/// Deeply nested brackets at a random place, closed or not: parsers must refuse them
/// without overflowing the stack.
fn nest(rng: &mut Rng, out: &mut Vec<u8>) {
    let (open, close) = *rng.pick(&[(b'[', b']'), (b'(', b')'), (b'{', b'}')]);
    let depth = *rng.pick(&[64, 200, 1_000, 10_000, 100_000]);
    let at = rng.below(out.len() + 1);
    let mut chunk = vec![open; depth];
    if rng.one_in(2) {
        chunk.extend(std::iter::repeat_n(close, depth));
    }
    out.splice(at..at, chunk);
}
