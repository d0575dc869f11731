//! Sizes that come from flags, checked before anything is built from them: a benchmark's
//! prompts (`--batch` × `--prompt-len` token ids) against the model's positions and a bound,
//! and the buffers of `bench-comm` and `bench-gemm` against the host's available memory.
//! An allocation that fails aborts the process; these say which flag to lower instead.

use tpc::plan::report::human_bytes;
use tpc::plan::Plan;

/// Prompt tokens one run builds at most (`--batch` × `--prompt-len`): 512 MiB of token
/// ids. Far beyond it the KV caches alone could not fit any host.
pub const MAX_PROMPT_TOKENS: u64 = 1 << 26;

/// The prompt flags of a command, by name, with their values.
pub struct PromptFlags<'a> {
    /// `--batch` and its value, where the command has one.
    pub batch: Option<(&'a str, u64)>,
    pub prompt_len: (&'a str, u64),
    /// New tokens per sequence: a flag and its value, or what the command always generates.
    pub new_tokens: NewTokens<'a>,
}

pub enum NewTokens<'a> {
    Flag(&'a str, u64),
    Fixed(u64, &'a str),
}

impl NewTokens<'_> {
    fn count(&self) -> u64 {
        match *self {
            NewTokens::Flag(_, n) | NewTokens::Fixed(n, _) => n,
        }
    }

    fn named(&self) -> String {
        match *self {
            NewTokens::Flag(flag, n) => format!(" and {flag} {n}"),
            NewTokens::Fixed(n, why) => format!(" and the {n} tokens {why}"),
        }
    }
}

/// Refuses prompts `flags` describe that `plan`'s model cannot run (more positions than it
/// has, a longer sequence than its attention window) or that are more tokens than a run
/// builds ([`MAX_PROMPT_TOKENS`]), naming the flags and the limit. The rule for positions is
/// the runtime's (`check_requests`): the last new token needs none.
pub fn check_prompts(plan: &Plan, flags: &PromptFlags) -> anyhow::Result<()> {
    let (prompt_flag, prompt) = flags.prompt_len;
    let new = flags.new_tokens.count();
    let given = format!("{prompt_flag} {prompt}{}", flags.new_tokens.named());
    if let Some(max) = plan.max_positions {
        let needed = prompt.saturating_add(new.saturating_sub(1));
        if needed > max {
            // The largest value of each flag that fits with the other as given.
            let prompt_fits = (max + 1).saturating_sub(new.max(1));
            let new_fits = match &flags.new_tokens {
                NewTokens::Flag(flag, _) if prompt <= max => Some((flag, max + 1 - prompt)),
                _ => None,
            };
            let hint = fix(prompt_flag, prompt_fits, new_fits, &flags.new_tokens);
            anyhow::bail!(
                "{given} need {needed} positions; the model `{}` has {max} (max_position_embeddings): {hint}",
                plan.model
            );
        }
    }
    if let Some(window) = plan.attention_window {
        let tokens = prompt.saturating_add(new);
        if tokens > window {
            // The runtime's words for why, then this command's flags.
            let why = tpc::frontend::spec::window_error(plan.model.clone(), window, tokens);
            let prompt_fits = window.saturating_sub(new);
            let new_fits = match &flags.new_tokens {
                NewTokens::Flag(flag, _) if prompt < window => Some((flag, window - prompt)),
                _ => None,
            };
            anyhow::bail!(
                "{why}. Here {given} make {tokens}: {}",
                fix(prompt_flag, prompt_fits, new_fits, &flags.new_tokens)
            );
        }
    }
    if let Some((batch_flag, batch)) = flags.batch {
        let total = batch
            .checked_mul(prompt)
            .filter(|&t| t <= MAX_PROMPT_TOKENS);
        if total.is_none() {
            anyhow::bail!(
                "{batch_flag} {batch} × {prompt_flag} {prompt} = {} prompt tokens; one run builds at most {MAX_PROMPT_TOKENS} (2^26): lower {batch_flag} or {prompt_flag}",
                batch as u128 * prompt as u128
            );
        }
    }
    Ok(())
}

/// What to lower: the prompt flag to at most `prompt_fits` (0: no prompt fits with the new
/// tokens asked), or the new-token flag to `new_fits` (if lowering it alone can help).
fn fix(
    prompt_flag: &str,
    prompt_fits: u64,
    new_fits: Option<(&&str, u64)>,
    new_tokens: &NewTokens,
) -> String {
    match (prompt_fits, new_fits) {
        (0, None) => match new_tokens {
            NewTokens::Flag(flag, _) => format!("lower {prompt_flag} and {flag}"),
            NewTokens::Fixed(..) => format!("lower {prompt_flag}"),
        },
        (0, Some((flag, n))) => format!("lower {flag} to at most {n}"),
        (p, None) => format!("lower {prompt_flag} to at most {p}"),
        (p, Some((flag, n))) => {
            format!("lower {prompt_flag} to at most {p} or {flag} to at most {n}")
        }
    }
}

/// Refuses `needed` bytes (saturated) that this host does not have available, saying what
/// needs them (`what`) and which flags to lower (`lower`). A host that does not say how
/// much it has is not refused.
pub fn check_memory(needed: u64, what: &str, lower: &str) -> anyhow::Result<()> {
    let Some(available) = tpc::runtime::memory::available_bytes() else {
        return Ok(());
    };
    if needed > available {
        anyhow::bail!(
            "{what}: about {} of memory needed, this host has {} available; lower {lower}",
            human_bytes(needed),
            human_bytes(available)
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> Plan {
        let def = tpc::frontend::load::load_model(std::path::Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/models/tiny-llama.ron"
        )))
        .unwrap();
        tpc::pipeline::compile(&def, 1).unwrap().plan
    }

    fn bench(batch: u64, prompt: u64, new: u64) -> anyhow::Result<()> {
        check_prompts(
            &tiny(),
            &PromptFlags {
                batch: Some(("--batch", batch)),
                prompt_len: ("--prompt-len", prompt),
                new_tokens: NewTokens::Flag("--max-new-tokens", new),
            },
        )
    }

    #[test]
    fn prompts_past_the_positions_or_the_bound_name_the_flags() {
        let max = tiny().max_positions.unwrap();
        assert_eq!(max, 256);
        // The last new token needs no position.
        bench(4096, 241, 16).unwrap();
        bench(1, 256, 1).unwrap();
        bench(1, 256, 0).unwrap();
        let e = bench(4096, 1 << 20, 16).unwrap_err().to_string();
        assert!(
            e.contains("--prompt-len 1048576 and --max-new-tokens 16 need 1048591 positions")
                && e.contains("has 256")
                && e.contains("lower --prompt-len to at most 241"),
            "{e}"
        );
        let e = bench(1, 1, 1 << 20).unwrap_err().to_string();
        assert!(e.ends_with("lower --max-new-tokens to at most 256"), "{e}");
        let e = bench(1, 200, 100).unwrap_err().to_string();
        assert!(
            e.ends_with("lower --prompt-len to at most 157 or --max-new-tokens to at most 57"),
            "{e}"
        );
        let e = bench(1, 300, 1000).unwrap_err().to_string();
        assert!(
            e.ends_with("lower --prompt-len and --max-new-tokens"),
            "{e}"
        );
        let fixed = PromptFlags {
            batch: None,
            prompt_len: ("--prompt-len", 300),
            new_tokens: NewTokens::Fixed(4, "verify generates"),
        };
        let e = check_prompts(&tiny(), &fixed).unwrap_err().to_string();
        assert!(
            e.contains("the 4 tokens verify generates") && e.contains("at most 253"),
            "{e}"
        );
        // A sliding window: the runtime's reason, then the flags.
        let mut windowed = tiny();
        windowed.attention_window = Some(8);
        let flags = PromptFlags {
            batch: Some(("--batch", 1)),
            prompt_len: ("--prompt-len", 6),
            new_tokens: NewTokens::Flag("--max-new-tokens", 3),
        };
        let e = check_prompts(&windowed, &flags).unwrap_err().to_string();
        assert!(
            e.contains("sliding_window")
                && e.contains("this one has 9")
                && e.ends_with(
                    "Here --prompt-len 6 and --max-new-tokens 3 make 9: lower --prompt-len to at most 5 or --max-new-tokens to at most 2"
                ),
            "{e}"
        );
        // Within the positions but past the bound on tokens built.
        let mut long = tiny();
        long.max_positions = Some(1 << 24);
        let flags = |batch| PromptFlags {
            batch: Some(("--batch", batch)),
            prompt_len: ("--prompt-len", 1 << 20),
            new_tokens: NewTokens::Flag("--max-new-tokens", 1),
        };
        check_prompts(&long, &flags(64)).unwrap();
        let e = check_prompts(&long, &flags(65)).unwrap_err().to_string();
        assert!(
            e.contains("--batch 65 × --prompt-len 1048576 = 68157440 prompt tokens")
                && e.contains("at most 67108864"),
            "{e}"
        );
        let e = check_prompts(&long, &flags(u64::MAX))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("= 19342813113834066794250240 prompt tokens"),
            "{e}"
        );
    }

    #[test]
    fn more_memory_than_the_host_has_is_refused() {
        check_memory(1, "buffers", "--x").unwrap();
        if tpc::runtime::memory::available_bytes().is_some() {
            let e = check_memory(u64::MAX, "the buffers", "--x")
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("the buffers: about") && e.contains("lower --x"),
                "{e}"
            );
        }
    }
}
