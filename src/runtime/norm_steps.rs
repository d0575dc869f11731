//! A rank's invariant norm fusions at run time (`plan::fuse_norm`): when the all-reduce of
//! a group runs, it also adds the residual and normalizes ([`Backend::all_reduce_add_rms_norm`]);
//! its value becomes the new residual, which the group's add hands on, and the norm's value
//! waits here until the norm's instruction takes it.

use super::backend::Backend;
use crate::plan::fuse_norm::{groups, ReduceNormGroup};
use crate::plan::RankProgram;
use std::collections::{HashMap, HashSet};

pub struct NormSteps<B: Backend> {
    /// Each group, by its all-reduce's id.
    pub by_reduce: HashMap<u32, ReduceNormGroup>,
    /// Each group's add (by id) → its all-reduce's id.
    pub adds: HashMap<u32, u32>,
    pub norms: HashSet<u32>,
    /// Normalized values made by their all-reduce's step, not yet taken by their norm.
    pub normed: HashMap<u32, B::Act>,
}

impl<B: Backend> NormSteps<B> {
    /// The groups `program` makes; a marked norm that makes none (a pipeline stage that
    /// holds part of its group) runs apart from its all-reduce, with the same values.
    pub fn new(program: &RankProgram) -> Self {
        let found = groups(program).0;
        NormSteps {
            adds: found
                .iter()
                .filter_map(|g| Some((g.add?.id, g.reduce)))
                .collect(),
            norms: found.iter().map(|g| g.norm).collect(),
            by_reduce: found.into_iter().map(|g| (g.reduce, g)).collect(),
            normed: HashMap::new(),
        }
    }

    /// Whether instruction `id` is the add or the norm of a step (it only hands on a value
    /// its all-reduce's step made).
    pub fn hands_on(&self, id: u32) -> bool {
        self.adds.contains_key(&id) || self.norms.contains(&id)
    }

    /// Gives the values still waiting (a call that stopped between a step and its norm)
    /// back to `backend`.
    pub fn release_waiting(&mut self, backend: &B) {
        for (_, y) in self.normed.drain() {
            backend.release(y);
        }
    }
}
