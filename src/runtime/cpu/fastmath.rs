//! `exp` written so that loops over slices vectorise (libm's `expf` is a call per element):
//! Cody–Waite reduction `x = n·ln2 + r`, |r| ≤ ln2/2, a degree-6 polynomial for `e^r` and
//! `2^n` built in the exponent bits. Relative error < 3e-7 (2.5 ulp) over the whole range (tested).

/// e^x for f32; 0 below -87.3 (where f32 results go subnormal) and +inf above 88.3 (where
/// the result is within 8 % of the largest f32).
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split so that n · LN2_HI is exact for |n| < 2^9.
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    // 1.5 · 2^23: adding it rounds to an integer held in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    let xc = x.clamp(-87.3, 88.3);
    let t = xc * LOG2E + ROUND;
    let n = t - ROUND;
    let r = xc - n * LN2_HI - n * LN2_LO;
    // Taylor terms to r^6: truncation ≤ |r|^7/7! < 1.2e-7 for |r| ≤ ln2/2.
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    // 2^n from the integer in t's low bits: (n + 127) << 23.
    let bits = (t.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    let scale = f32::from_bits(((bits + 127) as u32) << 23);
    let y = p * scale;
    if x < -87.3 {
        0.0
    } else if x > 88.3 {
        f32::INFINITY
    } else {
        y
    }
}

/// x · sigmoid(x).
#[inline(always)]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + exp(-x))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_within_3e_7_relative_everywhere() {
        let mut worst = 0f64;
        let mut x = -87.0f32;
        while x < 88.3 {
            let want = (x as f64).exp();
            let got = exp(x) as f64;
            worst = worst.max(((got - want) / want).abs());
            x += 0.0137;
        }
        assert!(worst < 3e-7, "worst relative error {worst:e}");
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-100.0), 0.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(100.0), f32::INFINITY);
    }

    #[test]
    fn silu_matches_its_definition() {
        for i in -400..400 {
            let x = i as f32 * 0.05;
            let want = x as f64 / (1.0 + (-x as f64).exp());
            assert!(
                (silu(x) as f64 - want).abs() <= 1e-6 * (1.0 + want.abs()),
                "{x}"
            );
        }
    }
}
