//! An f32 activation on the device, with the bf16 copy that products with bf16 weights read.
//! The copy is made by the first such product and kept until the activation is written
//! again, so the products that share an input (q, k and v; gate and up) round it once: one
//! launch and one allocation per product fewer on the decode path. Every write goes through
//! [`CudaAct::data_mut`], which drops the copy (the fields are private to this file, so
//! nothing else can write around it).

use crate::ir::DType;
use crate::runtime::backend::Activation;
use cudarc::driver::CudaSlice;
use std::sync::OnceLock;

pub struct CudaAct {
    shape: Vec<usize>,
    data: CudaSlice<f32>,
    /// `data` rounded to bf16 (as its bits), while `data` is unchanged since.
    rounded: OnceLock<CudaSlice<u16>>,
}

impl CudaAct {
    pub fn new(shape: Vec<usize>, data: CudaSlice<f32>) -> CudaAct {
        CudaAct {
            shape,
            data,
            rounded: OnceLock::new(),
        }
    }

    /// The device buffer, to read.
    pub fn data(&self) -> &CudaSlice<f32> {
        &self.data
    }

    /// The device buffer, to write: the bf16 copy, if any, is dropped.
    pub fn data_mut(&mut self) -> &mut CudaSlice<f32> {
        self.rounded.take();
        &mut self.data
    }

    /// The device buffer, to keep under another shape (its bf16 copy, if any, is dropped).
    pub fn into_data(self) -> CudaSlice<f32> {
        self.data
    }

    /// The bf16 copy, made by `round` from the f32 values if there is none yet.
    pub fn rounded<E>(
        &self,
        round: impl FnOnce(&CudaSlice<f32>) -> Result<CudaSlice<u16>, E>,
    ) -> Result<&CudaSlice<u16>, E> {
        if let Some(r) = self.rounded.get() {
            return Ok(r);
        }
        let r = round(&self.data)?;
        // Only `&mut self` clears it, so nothing set it since the check above.
        Ok(self.rounded.get_or_init(|| r))
    }
}

impl Activation for CudaAct {
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn dtype(&self) -> DType {
        DType::F32
    }
}
