//! What an activation buffer is to the device-neutral code: its shape and dtype
//! ([`Activation`]), and its values as host data where a communicator must move them
//! ([`HostBuffer`]). Backends, collectives and communicators all build on it.

use crate::ir::DType;

/// A backend's activation buffer: a dense row-major tensor on the device.
pub trait Activation: Send {
    fn shape(&self) -> &[usize];
    fn dtype(&self) -> DType;
    /// Rows and columns when seen as a matrix over the last dim.
    fn rows_cols(&self) -> (usize, usize) {
        let shape = self.shape();
        let cols = shape.last().copied().unwrap_or(1);
        let elements: usize = shape.iter().product();
        (elements.checked_div(cols).unwrap_or(0), cols)
    }
    fn elements(&self) -> usize {
        self.shape().iter().product()
    }
}

/// A host buffer's elements, in its dtype.
pub enum HostData<'a> {
    F32(&'a mut [f32]),
    Bf16(&'a mut [half::bf16]),
}

/// A host buffer's elements, read only.
pub enum HostDataRef<'a> {
    F32(&'a [f32]),
    Bf16(&'a [half::bf16]),
}

/// Buffers that live in host memory, so any host communicator can move them.
pub trait HostBuffer {
    fn host_data(&mut self) -> HostData<'_>;
    fn host_data_ref(&self) -> HostDataRef<'_>;
}
