//! `--ep` with ranks as MPI processes: a DP group's all-to-all of parcels
//! ([`crate::runtime::expert_exchange::Exchanger`]) over an MPI sub-communicator cut from the
//! rank layout's DP groups. Each round first swaps every pair's header (rows, value count,
//! routing count, idle) in a fixed-size `MPI_Alltoall`, so the variable-size `MPI_Alltoallv`
//! of values and routing weights after it cannot be truncated.
//!
//! A member does not `leave` under MPI: a failed process ends the job (`MPI_Abort` from the
//! launcher), as for every other collective.

use crate::runtime::expert_exchange::{check_call, ExchangeError, Exchanger, Parcel, Round};
use mpi::datatype::{Partition, PartitionMut};
use mpi::topology::{Communicator as _, SimpleCommunicator};
use mpi::traits::CommunicatorCollectives;
use std::sync::Mutex;

/// One process's end of its DP group's exchange.
pub struct MpiExchange {
    comm: Mutex<SimpleCommunicator>,
    members: usize,
}

// SAFETY: MPI is initialized with at least `MPI_THREAD_SERIALIZED` (the process launcher
// refuses less), and the mutex keeps calls on this communicator from overlapping.
unsafe impl Send for MpiExchange {}
unsafe impl Sync for MpiExchange {}

impl MpiExchange {
    pub fn new(comm: SimpleCommunicator) -> Self {
        let members = comm.size().max(1) as usize;
        MpiExchange {
            comm: Mutex::new(comm),
            members,
        }
    }
}

/// Counts and offsets of parts of `lens` elements, as MPI's C ints; `None` past them.
fn layout(lens: impl Iterator<Item = usize>) -> Option<(Vec<i32>, Vec<i32>, usize)> {
    let (mut counts, mut offsets, mut at) = (Vec::new(), Vec::new(), 0usize);
    for len in lens {
        offsets.push(i32::try_from(at).ok()?);
        counts.push(i32::try_from(len).ok()?);
        at = at.checked_add(len)?;
    }
    i32::try_from(at).ok()?;
    Some((counts, offsets, at))
}

/// `parts[j]` to member j, each member's part for this one back, through `MPI_Alltoallv`.
fn swap(
    comm: &SimpleCommunicator,
    parts: &[&[f32]],
    incoming: &[usize],
    member: usize,
) -> Result<Vec<Vec<f32>>, ExchangeError> {
    let too_large = || ExchangeError::TooLarge { member };
    let (send_counts, send_offsets, _) =
        layout(parts.iter().map(|p| p.len())).ok_or_else(too_large)?;
    let (recv_counts, recv_offsets, total) =
        layout(incoming.iter().copied()).ok_or_else(too_large)?;
    let flat: Vec<f32> = parts.concat();
    let mut got = vec![0f32; total];
    {
        let send = Partition::new(&flat[..], &send_counts[..], &send_offsets[..]);
        let mut recv = PartitionMut::new(&mut got[..], &recv_counts[..], &recv_offsets[..]);
        comm.all_to_all_varcount_into(&send, &mut recv);
    }
    Ok(recv_counts
        .iter()
        .zip(&recv_offsets)
        .map(|(&c, &o)| got[o as usize..(o + c) as usize].to_vec())
        .collect())
}

impl Exchanger for MpiExchange {
    fn members(&self) -> usize {
        self.members
    }

    fn all_to_all(
        &self,
        member: usize,
        parcels: Vec<Parcel>,
        idle: bool,
    ) -> Result<Round, ExchangeError> {
        let members = self.members;
        check_call(member, members, parcels.len())?;
        let comm = self.comm.lock().unwrap_or_else(|p| p.into_inner());
        // Four words per pair: rows, values, routing weights, idle.
        let header: Vec<u64> = parcels
            .iter()
            .flat_map(|p| {
                [
                    p.rows as u64,
                    p.values.len() as u64,
                    p.routing.len() as u64,
                    u64::from(idle),
                ]
            })
            .collect();
        let mut heard = vec![0u64; 4 * members];
        comm.all_to_all_into(&header[..], &mut heard[..]);
        let all_idle = heard.chunks_exact(4).all(|h| h[3] == 1);
        if all_idle {
            return Ok(Round {
                parcels: vec![Parcel::default(); members],
                all_idle,
            });
        }
        let size = |i: usize| -> Vec<usize> {
            heard
                .chunks_exact(4)
                .map(|h| usize::try_from(h[i]).unwrap_or(usize::MAX))
                .collect()
        };
        let values: Vec<&[f32]> = parcels.iter().map(|p| p.values.as_slice()).collect();
        let values = swap(&comm, &values, &size(1), member)?;
        let routing: Vec<&[f32]> = parcels.iter().map(|p| p.routing.as_slice()).collect();
        let routing = swap(&comm, &routing, &size(2), member)?;
        let parcels = size(0)
            .into_iter()
            .zip(values.into_iter().zip(routing))
            .map(|(rows, (values, routing))| Parcel {
                rows,
                values,
                routing,
            })
            .collect();
        Ok(Round { parcels, all_idle })
    }

    fn leave(&self, _member: usize, _why: &str) {}

    /// Replicas under MPI run `tpc run`'s batches only (`tpc serve` under mpirun has one
    /// replica), so none waits for calls between requests.
    fn wait_for_call(
        &self,
        member: usize,
        _timeout: std::time::Duration,
    ) -> Result<bool, ExchangeError> {
        Err(ExchangeError::CannotWait {
            member,
            why: "replicas as MPI processes",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::layout;

    #[test]
    fn parts_are_laid_out_end_to_end_within_mpi_counts() {
        assert_eq!(
            layout([3, 0, 2].into_iter()),
            Some((vec![3, 0, 2], vec![0, 3, 3], 5))
        );
        // Each part fits a C int, their sum does not.
        let half = i32::MAX as usize / 2 + 1;
        assert_eq!(layout([half, half].into_iter()), None);
        assert_eq!(layout([i32::MAX as usize + 1].into_iter()), None);
    }
}
