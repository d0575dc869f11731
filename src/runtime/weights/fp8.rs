//! FP8 e4m3 weights with block scales (`quant_method: "fp8"`, the layout of the Qwen3 and
//! DeepSeek FP8 releases): a linear weight `W [out, in]` is stored one byte an element
//! (`float8_e4m3fn`), and `W_scale_inv [⌈out/b₀⌉, ⌈in/b₁⌉]` holds one f32 per block;
//! an element's value is its e4m3 value times its block's scale, which is how transformers
//! dequantizes these checkpoints on a CPU. [`BlockScales`] serves compressed-tensors' INT8
//! and FP8 weights with a scale per output channel too (`W_scale [out, 1]`: blocks of one
//! row by the whole row).

/// The f32 value of every e4m3fn byte (`s eeee mmm`, bias 7, no infinities, `0x7f` and
/// `0xff` NaN): built once at compile time, exact.
static E4M3: [f32; 256] = e4m3_table();

const fn e4m3_table() -> [f32; 256] {
    let mut t = [0.0f32; 256];
    let mut b = 0;
    while b < 256 {
        let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
        let exp = ((b >> 3) & 0xf) as i32;
        let man = (b & 7) as f32;
        t[b] = if b & 0x7f == 0x7f {
            f32::NAN
        } else if exp == 0 {
            // Subnormal: m/8 · 2⁻⁶.
            sign * man / 8.0 / 64.0
        } else {
            sign * (1.0 + man / 8.0) * pow2(exp - 7)
        };
        b += 1;
    }
    t
}

const fn pow2(e: i32) -> f32 {
    let mut v = 1.0f32;
    let mut i = 0;
    while i < e.abs() {
        v = if e > 0 { v * 2.0 } else { v / 2.0 };
        i += 1;
    }
    v
}

/// The value of one stored e4m3 byte, before its block's scale.
pub fn e4m3_to_f32(byte: u8) -> f32 {
    E4M3[byte as usize]
}

/// One weight's block scales, as read from its `_scale_inv` tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockScales {
    /// What the codes are.
    pub format: crate::ir::QuantFormat,
    /// Elements per block along the weight's rows and columns.
    pub block: [usize; 2],
    /// The weight's stored columns.
    pub cols: usize,
    /// Scales per row of blocks: `⌈cols / block[1]⌉`.
    pub per_row: usize,
    /// `⌈rows / block[0]⌉ · per_row` scales, row-major.
    pub values: Vec<f32>,
}

impl BlockScales {
    /// Where in `values` the scale of stored element `element` (row-major) is; checked
    /// against the scales' length when they were read.
    pub fn index_of(&self, element: usize) -> usize {
        let (row, col) = (element / self.cols.max(1), element % self.cols.max(1));
        (row / self.block[0]) * self.per_row + col / self.block[1]
    }

    /// Turns the e4m3 values of stored elements `[from, from + out.len())` of the flat
    /// weight, already decoded into `out`, into the weight's values. The caller read those
    /// elements from the weight, so every block they fall in has a scale.
    pub fn apply(&self, from: usize, out: &mut [f32]) {
        let mut at = from;
        let mut rest = out;
        while !rest.is_empty() {
            let (row, col) = (at / self.cols, at % self.cols);
            // To the end of this row's block of columns.
            let run = (self.block[1] - col % self.block[1])
                .min(self.cols - col)
                .min(rest.len());
            let scale = self
                .values
                .get((row / self.block[0]) * self.per_row + col / self.block[1])
                .copied()
                .unwrap_or(f32::NAN);
            let (here, tail) = std::mem::take(&mut rest).split_at_mut(run);
            for v in here {
                *v *= scale;
            }
            rest = tail;
            at += run;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_bytes_decode_to_their_values() {
        assert_eq!(e4m3_to_f32(0x00), 0.0);
        assert_eq!(e4m3_to_f32(0x80), -0.0);
        // 1.0 = exponent 7, mantissa 0.
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        assert_eq!(e4m3_to_f32(0xb8), -1.0);
        // The largest finite value, 448 = 1.75 · 2⁸.
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
        // The smallest subnormal, 2⁻⁹, and the largest, 7/8 · 2⁻⁶.
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0x07), 0.875 * 2f32.powi(-6));
        assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6));
        assert!(e4m3_to_f32(0x7f).is_nan() && e4m3_to_f32(0xff).is_nan());
        // Every byte against the format's definition, by another route.
        for b in 0..=255u8 {
            let (s, e, m) = (b >> 7, (b >> 3) & 0xf, b & 7);
            if b & 0x7f == 0x7f {
                continue;
            }
            let mag = if e == 0 {
                m as f64 * 2f64.powi(-9)
            } else {
                (8 + m) as f64 * 2f64.powi(e as i32 - 10)
            };
            let want = if s == 1 { -mag } else { mag } as f32;
            assert_eq!(e4m3_to_f32(b).to_bits(), want.to_bits(), "byte {b:#04x}");
        }
    }

    #[test]
    fn each_element_takes_its_blocks_scale() {
        // A 5 × 6 weight in 2 × 4 blocks: 3 × 2 scales, the last row and column partial.
        let s = BlockScales {
            format: crate::ir::QuantFormat::Fp8E4m3,
            block: [2, 4],
            cols: 6,
            per_row: 2,
            values: vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
        };
        let mut all = vec![1.0f32; 30];
        s.apply(0, &mut all);
        let want: Vec<f32> = (0..30)
            .map(|i| s.values[(i / 6 / 2) * 2 + (i % 6) / 4])
            .collect();
        assert_eq!(all, want);
        // A run that starts mid-row and crosses rows takes the same values.
        let mut part = vec![1.0f32; 11];
        s.apply(9, &mut part);
        assert_eq!(part, want[9..20]);
    }
}
