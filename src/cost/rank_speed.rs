//! One rank's device speed relative to a profile's figures, for unequal devices. A device
//! can lag differently in compute-bound work (a prompt's products) and in bandwidth-bound
//! work (a decode step's weight reads): a CPU core without the wide kernels falls further
//! behind in the first. So an entry is one number for both, or the two apart.

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A rank's speed: `compute` scales its FLOP rates (and per-op overhead), `memory` its
/// read bandwidth (weights, KV cache, elementwise ops); 1.0 is the profile's device.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RankSpeed {
    pub compute: f64,
    pub memory: f64,
}

impl RankSpeed {
    /// The profile's own device.
    pub const SAME: RankSpeed = RankSpeed::both(1.0);

    /// One speed for compute and memory.
    pub const fn both(speed: f64) -> RankSpeed {
        RankSpeed {
            compute: speed,
            memory: speed,
        }
    }

    /// The first figure outside 0.001..=1000 (or not a normal number), if any.
    pub fn out_of_range(self) -> Option<f64> {
        [self.compute, self.memory]
            .into_iter()
            .find(|v| !(v.is_normal() && (1e-3..=1e3).contains(v)))
    }
}

impl std::fmt::Display for RankSpeed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.compute == self.memory {
            write!(f, "{}", self.memory)
        } else {
            write!(f, "(compute {}, memory {})", self.compute, self.memory)
        }
    }
}

/// The written forms: `0.5`, or `(compute: 0.15, memory: 0.2)`.
#[derive(Serialize, Deserialize)]
#[serde(untagged)]
enum Written {
    Both(f64),
    Apart(Apart),
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Apart {
    compute: f64,
    memory: f64,
}

impl Serialize for RankSpeed {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if self.compute == self.memory {
            Written::Both(self.memory)
        } else {
            Written::Apart(Apart {
                compute: self.compute,
                memory: self.memory,
            })
        }
        .serialize(s)
    }
}

impl<'de> Deserialize<'de> for RankSpeed {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(
            match Written::deserialize(d).map_err(|_| {
                serde::de::Error::custom(
                    "a rank speed is a number (e.g. 0.5) or (compute: C, memory: M)",
                )
            })? {
                Written::Both(v) => RankSpeed::both(v),
                Written::Apart(a) => RankSpeed {
                    compute: a.compute,
                    memory: a.memory,
                },
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Vec<RankSpeed>, ron::error::SpannedError> {
        ron::from_str(text)
    }

    #[test]
    fn a_speed_is_one_number_or_compute_and_memory_apart() {
        let s = parse("[1.0, 0.5, (compute: 0.15, memory: 0.2)]").unwrap();
        assert_eq!(s[0], RankSpeed::SAME);
        assert_eq!(s[1], RankSpeed::both(0.5));
        assert_eq!(
            s[2],
            RankSpeed {
                compute: 0.15,
                memory: 0.2
            }
        );
        // Written back in the same forms.
        let text = ron::to_string(&s).unwrap();
        assert_eq!(parse(&text).unwrap(), s);
        assert_eq!(s[2].to_string(), "(compute 0.15, memory 0.2)");
        assert_eq!(s[1].to_string(), "0.5");
    }

    #[test]
    fn other_forms_are_refused_with_the_two_forms_named() {
        for bad in [
            "[(compute: 0.1)]",
            "[(compute: 0.1, memory: 0.2, disk: 1.0)]",
            "[\"x\"]",
        ] {
            let e = parse(bad).unwrap_err().to_string();
            assert!(e.contains("(compute: C, memory: M)"), "{bad}: {e}");
        }
        assert_eq!(RankSpeed::both(0.0).out_of_range(), Some(0.0));
        let s = RankSpeed {
            compute: 0.5,
            memory: 2e3,
        };
        assert_eq!(s.out_of_range(), Some(2e3));
        assert_eq!(RankSpeed::both(0.25).out_of_range(), None);
    }
}
