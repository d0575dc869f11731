//! Tests of the whole compiler that check what a layer below the plan (frontend, passes)
//! made of a compiled model: compiling one is above those layers, so their checks live here.

mod fuse_norm_marks;
mod head_sizes;
mod invariant_blocks;
