//! Which part of a generation's text may be sent: the decode of all its tokens grows, and
//! what is sent is its prefix that is settled. A text ending in U+FFFD (a character whose
//! bytes have not all arrived) and a tail that may be the start of a stop string wait for
//! the next token; a stop string ends the text before it.

/// What one step adds to the sent text.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Advance {
    pub text: String,
    /// A stop string appeared: the text ends here, before it.
    pub stopped: bool,
}

/// The sent text of one generation and its stop strings.
#[derive(Debug, Clone, Default)]
pub struct TextEmitter {
    stops: Vec<String>,
    sent: String,
    stopped: bool,
}

impl TextEmitter {
    pub fn new(stops: Vec<String>) -> TextEmitter {
        TextEmitter {
            stops,
            ..TextEmitter::default()
        }
    }

    /// `full` is the decode of every token generated so far; `last`: no token follows, so
    /// nothing is held back any more.
    pub fn advance(&mut self, full: &str, last: bool) -> Advance {
        if self.stopped || !full.starts_with(self.sent.as_str()) {
            // A decoder that rewrites earlier text: wait until it agrees again (sent text
            // cannot be taken back).
            return Advance::default();
        }
        let start = self.sent.len();
        let first_stop = self
            .stops
            .iter()
            .filter_map(|s| full.find(s.as_str()))
            .min();
        if let Some(at) = first_stop {
            self.stopped = true;
            let text = full.get(start..at).unwrap_or("").to_string();
            self.sent.push_str(&text);
            return Advance {
                text,
                stopped: true,
            };
        }
        let mut end = full.len();
        if !last {
            end = full.trim_end_matches('\u{FFFD}').len();
            let settled = &full[..end];
            let held = self
                .stops
                .iter()
                .filter_map(|stop| longest_start_at_end(settled, stop))
                .max()
                .unwrap_or(0);
            end -= held;
        }
        let text = full.get(start..end.max(start)).unwrap_or("").to_string();
        self.sent.push_str(&text);
        Advance {
            text,
            stopped: false,
        }
    }
}

/// The length of the longest proper start of `stop` that `text` ends with, if any.
fn longest_start_at_end(text: &str, stop: &str) -> Option<usize> {
    stop.char_indices()
        .map(|(i, _)| i)
        .filter(|&i| i > 0)
        .rev()
        .find(|&i| text.ends_with(&stop[..i]))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds the successive full texts and returns the pieces sent and whether it stopped.
    fn run(stops: &[&str], texts: &[&str]) -> (Vec<String>, bool) {
        let mut e = TextEmitter::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = Vec::new();
        for (i, t) in texts.iter().enumerate() {
            let a = e.advance(t, i + 1 == texts.len());
            out.push(a.text);
            if a.stopped {
                return (out, true);
            }
        }
        (out, false)
    }

    #[test]
    fn text_is_sent_as_it_grows() {
        assert_eq!(
            run(&[], &["a", "ab", "abc"]),
            (vec!["a".into(), "b".into(), "c".into()], false)
        );
    }

    #[test]
    fn a_partial_character_waits_for_its_other_bytes() {
        let (out, _) = run(&[], &["x\u{FFFD}", "x\u{FFFD}\u{FFFD}", "x€", "x€y"]);
        assert_eq!(out, ["x", "", "€", "y"]);
        // At the end a lone U+FFFD is text like any other.
        let (out, _) = run(&[], &["x", "x\u{FFFD}"]);
        assert_eq!(out, ["x", "\u{FFFD}"]);
    }

    #[test]
    fn a_stop_string_cuts_the_text_before_it() {
        assert_eq!(
            run(&["END"], &["ab", "abEN", "abENDcd"]),
            (vec!["ab".into(), "".into(), "".into()], true)
        );
        // The earliest of several stops wins.
        assert_eq!(run(&["c", "b"], &["xabc"]), (vec!["xa".into()], true));
    }

    #[test]
    fn the_start_of_a_stop_string_is_held_until_it_is_not_one() {
        // "EN" could start "END": held, then sent once "ENx" shows it was not.
        assert_eq!(
            run(&["END"], &["abE", "abEN", "abENx", "abENxy"]),
            (
                vec!["ab".into(), "".into(), "ENx".into(), "y".into()],
                false
            )
        );
        // At the end the held text is sent.
        assert_eq!(
            run(&["END"], &["ab", "abEN"]),
            (vec!["ab".into(), "EN".into()], false)
        );
        // A multi-byte stop string held at a character boundary.
        assert_eq!(
            run(&["é!"], &["aé", "aé!"]),
            (vec!["a".into(), "".into()], true)
        );
    }

    #[test]
    fn earlier_text_that_changes_is_not_sent_twice() {
        let mut e = TextEmitter::new(vec![]);
        assert_eq!(e.advance("ab", false).text, "ab");
        assert_eq!(e.advance("aX", false).text, "");
        assert_eq!(e.advance("abc", true).text, "c");
    }
}
