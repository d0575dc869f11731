//! Rotary frequency tables, with the llama3 and linear scalings, computed the way
//! transformers computes them (in f64 here, which only removes rounding).

use crate::ir::{RopeOp, RopeScaling};

/// Inverse frequencies for the rotary dims of `op`.
pub fn inv_freq(op: &RopeOp) -> Vec<f64> {
    let dim = op.rotary_dim as f64;
    let base = op.theta.0;
    let mut f: Vec<f64> = (0..op.rotary_dim / 2)
        .map(|i| 1.0 / base.powf((2 * i) as f64 / dim))
        .collect();
    match &op.scaling {
        None => {}
        Some(RopeScaling::Linear { factor }) => f.iter_mut().for_each(|x| *x /= factor.0),
        Some(RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        }) => {
            let (factor, low, high) = (factor.0, low_freq_factor.0, high_freq_factor.0);
            let old = *original_max_position_embeddings as f64;
            let low_wavelen = old / low;
            let high_wavelen = old / high;
            for x in f.iter_mut() {
                let wavelen = 2.0 * std::f64::consts::PI / *x;
                if wavelen > low_wavelen {
                    *x /= factor;
                } else if wavelen >= high_wavelen {
                    // Between the two wavelengths: blend scaled and unscaled.
                    let smooth = (old / wavelen - low) / (high - low);
                    *x = (1.0 - smooth) * *x / factor + smooth * *x;
                }
            }
        }
    }
    f
}

/// Rotary tables for a run of positions: `cos`/`sin` of `[positions, rotary_dim / 2]`.
#[derive(Debug, Clone)]
pub struct RopeTables {
    pub half: usize,
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
}

/// cos/sin for each of `positions`.
pub fn tables(op: &RopeOp, positions: &[i64]) -> RopeTables {
    let f = inv_freq(op);
    let half = f.len();
    let mut cos = Vec::with_capacity(positions.len() * half);
    let mut sin = Vec::with_capacity(positions.len() * half);
    for &p in positions {
        for &x in &f {
            let angle = p as f64 * x;
            cos.push(angle.cos() as f32);
            sin.push(angle.sin() as f32);
        }
    }
    RopeTables { half, cos, sin }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::F64;

    #[test]
    fn llama3_scaling_keeps_high_frequencies_and_divides_low_ones() {
        let plain = RopeOp {
            head_dim: 128,
            rotary_dim: 128,
            theta: F64(500000.0),
            scaling: None,
        };
        let scaled = RopeOp {
            scaling: Some(RopeScaling::Llama3 {
                factor: F64(8.0),
                low_freq_factor: F64(1.0),
                high_freq_factor: F64(4.0),
                original_max_position_embeddings: 8192,
            }),
            ..plain.clone()
        };
        let (a, b) = (inv_freq(&plain), inv_freq(&scaled));
        assert_eq!(a[0], b[0], "the highest frequency is unchanged");
        assert!(
            (b[63] - a[63] / 8.0).abs() < 1e-18,
            "the lowest is divided by the factor"
        );
        assert!(b.iter().zip(&a).all(|(b, a)| b <= a));
    }
}
