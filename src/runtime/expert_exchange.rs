//! Expert parallelism across data-parallel replicas (`--dp D --ep`): the experts a tp rank
//! holds are dealt again over the D replicas at that tp rank (a DP group of `tpc ranks`; the
//! DP groups of one stage together make its EP group, DP × TP), so each replica keeps 1/D of
//! them. Replicas run different requests, so at every mixture-of-experts layer the members
//! of a DP group swap tokens: each sends every other the rows routed to that member's
//! experts (dispatch), computes its experts for all the rows it got, and sends the results
//! back (combine). This file is the swap itself ([`Exchanger`]: an all-to-all of host
//! parcels; here between the replicas' threads, `processes/` has one over MPI), the deal of
//! routing columns, and which plans can deal their experts so.
//!
//! A replica that has finished its requests keeps serving the others' rounds (with nothing
//! of its own) until every member is idle; a replica that stops (an error, a panic) leaves,
//! and every member waiting on it fails instead of waiting forever. A serving replica with
//! no requests but still open waits for a member with tokens to start a round
//! ([`Exchanger::wait_for_call`]) and answers it.

use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Rows of one member's tokens for one other member: `rows × width` values and, beside
/// them, `rows × columns` routing weights (empty in a combine).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Parcel {
    pub rows: usize,
    pub values: Vec<f32>,
    pub routing: Vec<f32>,
}

/// What one round gave a member: a parcel from every member (its own included), by member,
/// and whether every member came idle (then nothing was sent and the members stop).
#[derive(Debug)]
pub struct Round {
    pub parcels: Vec<Parcel>,
    pub all_idle: bool,
}

#[derive(Debug)]
struct State {
    /// Whether deposits for the current round are still coming in (else it is being taken).
    filling: bool,
    arrived: usize,
    idle: usize,
    /// Members of the filling round that are not idle (they have tokens, or answer while
    /// they may still get some).
    busy: usize,
    taken: usize,
    /// `boxes[to][from]`.
    boxes: Vec<Vec<Option<Parcel>>>,
    /// A member that stopped, and why.
    left: Option<(usize, String)>,
}

/// A DP group's all-to-all of parcels, whatever carries them.
pub trait Exchanger: Send + Sync {
    fn members(&self) -> usize;
    /// Member `member` sends `parcels[j]` to member j and gets every member's parcel for it.
    /// `idle`: this member has no tokens of its own left and will get none (its parcels are
    /// empty); the round in which every member is idle is the last.
    fn all_to_all(
        &self,
        member: usize,
        parcels: Vec<Parcel>,
        idle: bool,
    ) -> Result<Round, ExchangeError>;
    /// Member `member` will take part in no further round (it is done or has failed).
    fn leave(&self, member: usize, why: &str);
    /// For a member with nothing of its own to run that may still get requests (a serving
    /// replica): waits up to `timeout` for a member that is not idle to start a round, which
    /// this one must then join. Whether one has; a member that left fails it.
    fn wait_for_call(&self, member: usize, timeout: Duration) -> Result<bool, ExchangeError>;
}

/// Refuses a round by a member outside the group, or with other than a parcel per member.
pub fn check_call(member: usize, members: usize, parcels: usize) -> Result<(), ExchangeError> {
    if member >= members || parcels != members {
        return Err(ExchangeError::Misuse {
            member,
            members,
            parcels,
        });
    }
    Ok(())
}

/// One DP group's all-to-all: `members` replicas' threads at the same tp rank.
#[derive(Debug)]
pub struct ExpertExchange {
    members: usize,
    state: Mutex<State>,
    turn: Condvar,
}

/// Why a round could not complete.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExchangeError {
    #[error("replica {member} stopped ({why}), so the experts it holds cannot answer; see its own error")]
    MemberLeft { member: usize, why: String },
    #[error("a round's parcels of member {member} exceed what MPI counts (2^31 - 1 elements); use smaller batches or more replicas")]
    TooLarge { member: usize },
    #[error("replica {member} cannot wait for the others' calls over this exchange ({why}); serve with the replicas as threads")]
    CannotWait { member: usize, why: &'static str },
    #[error("member {member} called a round of an exchange of {members} members with {parcels} parcels (one per member is needed); a bug in tpc")]
    Misuse {
        member: usize,
        members: usize,
        parcels: usize,
    },
}

impl ExpertExchange {
    pub fn new(members: usize) -> Self {
        ExpertExchange {
            members,
            state: Mutex::new(State {
                filling: true,
                arrived: 0,
                idle: 0,
                busy: 0,
                taken: 0,
                boxes: vec![vec![None; members]; members],
                left: None,
            }),
            turn: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A member that panicked holding the lock left nothing half-done that matters here:
        // its replica reports the panic, and `leave` stops the others.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn wait<'a>(&self, s: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        self.turn.wait(s).unwrap_or_else(|p| p.into_inner())
    }

    fn left(s: &State) -> Option<ExchangeError> {
        s.left
            .as_ref()
            .map(|(member, why)| ExchangeError::MemberLeft {
                member: *member,
                why: why.clone(),
            })
    }
}

impl Exchanger for ExpertExchange {
    fn members(&self) -> usize {
        self.members
    }

    fn all_to_all(
        &self,
        member: usize,
        parcels: Vec<Parcel>,
        idle: bool,
    ) -> Result<Round, ExchangeError> {
        check_call(member, self.members, parcels.len())?;
        let left = Self::left;
        let mut s = self.lock();
        // The last round is still being taken: wait for it to empty.
        while !s.filling {
            if let Some(e) = left(&s) {
                return Err(e);
            }
            s = self.wait(s);
        }
        if let Some(e) = left(&s) {
            return Err(e);
        }
        for (to, p) in parcels.into_iter().enumerate() {
            s.boxes[to][member] = Some(p);
        }
        s.arrived += 1;
        s.idle += usize::from(idle);
        s.busy += usize::from(!idle);
        if s.arrived == self.members {
            s.filling = false;
            self.turn.notify_all();
        } else if !idle {
            // Members waiting for a call (`wait_for_call`) join this round.
            self.turn.notify_all();
        }
        while s.filling {
            if let Some(e) = left(&s) {
                return Err(e);
            }
            s = self.wait(s);
        }
        let parcels = s.boxes[member]
            .iter_mut()
            .map(|p| p.take().unwrap_or_default())
            .collect();
        // The round's idle count stays until its last member has taken its parcels.
        let all_idle = s.idle == self.members;
        s.taken += 1;
        if s.taken == self.members {
            s.arrived = 0;
            s.idle = 0;
            s.busy = 0;
            s.taken = 0;
            s.filling = true;
            self.turn.notify_all();
        }
        Ok(Round { parcels, all_idle })
    }

    /// Every member waiting in a round, now or later, fails. After the round in which all
    /// were idle nobody waits, so a normal end fails no one.
    fn leave(&self, member: usize, why: &str) {
        let mut s = self.lock();
        if s.left.is_none() {
            s.left = Some((member, why.to_string()));
        }
        self.turn.notify_all();
    }

    fn wait_for_call(&self, member: usize, timeout: Duration) -> Result<bool, ExchangeError> {
        check_call(member, self.members, self.members)?;
        let until = Instant::now() + timeout;
        let mut s = self.lock();
        loop {
            if let Some(e) = Self::left(&s) {
                return Err(e);
            }
            // A round that is filling with a caller in it waits for this member.
            if s.filling && s.busy > 0 {
                return Ok(true);
            }
            let now = Instant::now();
            if now >= until {
                return Ok(false);
            }
            s = self
                .turn
                .wait_timeout(s, until - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

/// Routing columns `0..columns` dealt to `members` in order, as evenly as whole columns
/// allow (the first ones one more): member j computes the experts of `deal[j]`.
pub fn deal_columns(columns: usize, members: usize) -> Vec<Range<usize>> {
    let members = members.max(1);
    let (base, extra) = (columns / members, columns % members);
    let mut start = 0;
    (0..members)
        .map(|j| {
            let len = base + usize::from(j < extra);
            let r = start..start + len;
            start += len;
            r
        })
        .collect()
}

/// One replica's place in the EP group: the exchange of each of its ranks' DP groups
/// (index: the replica's global rank, stage · tp + tp rank) and its member index there.
#[derive(Debug, Clone)]
pub struct ExpertSeat {
    pub exchanges: Arc<Vec<Arc<ExpertExchange>>>,
    pub member: usize,
}

/// A tp rank's seat: its DP group's exchange and its member index there.
#[derive(Clone)]
pub struct ExpertMember {
    pub exchange: Arc<dyn Exchanger>,
    pub member: usize,
}

impl std::fmt::Debug for ExpertMember {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "member {} of {}", self.member, self.exchange.members())
    }
}

impl ExpertSeat {
    /// The seat of this replica's global rank `rank` (stage · tp + tp rank).
    pub fn member(&self, rank: usize) -> Option<ExpertMember> {
        Some(ExpertMember {
            exchange: self.exchanges.get(rank)?.clone() as Arc<dyn Exchanger>,
            member: self.member,
        })
    }

    /// This replica stops: every exchange it is in learns of it.
    pub fn leave(&self, why: &str) {
        for x in self.exchanges.iter() {
            x.leave(self.member, why);
        }
    }
}

/// Leaves a DP group's exchange unless disarmed (set to `None`): a rank that fails or
/// panics releases the other replicas waiting on its experts at once.
pub struct LeaveUnlessDone(pub Option<ExpertMember>);

impl Drop for LeaveUnlessDone {
    fn drop(&mut self) {
        if let Some(m) = self.0.take() {
            m.exchange.leave(m.member, "its rank failed");
        }
    }
}

/// The seats of `dp` replicas of `pp` stages of `tp` ranks, one exchange per DP group of the
/// rank layout (`tpc ranks --world dp·pp·tp --tp tp --pp pp --dp dp`: the same rank of every
/// replica), members in the group's (replica) order; a seat's exchanges by the replica's
/// global rank (stage · tp + tp rank).
pub fn expert_seats(tp: usize, pp: usize, dp: usize) -> Result<Vec<ExpertSeat>, String> {
    let ranks = tp.saturating_mul(pp);
    let world = (ranks as u64).saturating_mul(dp as u64);
    let groups = super::rank_groups::rank_groups(world, tp as u64, pp as u64, dp as u64)
        .map_err(|e| e.to_string())?;
    // One exchange per DP group; `by_rank[g]` is the replica's global rank g's.
    let mut by_rank: Vec<Option<Arc<ExpertExchange>>> = vec![None; ranks];
    for group in &groups.dp_groups {
        let c = &groups.ranks[group[0]];
        if let Some(slot) = by_rank.get_mut(c.pp * tp + c.tp) {
            *slot = Some(Arc::new(ExpertExchange::new(group.len())));
        }
    }
    let exchanges: Vec<Arc<ExpertExchange>> = by_rank.into_iter().flatten().collect();
    if exchanges.len() != ranks {
        return Err(format!(
            "the layout of {dp} replicas of {pp} stage(s) of {tp} ranks has {} DP groups, expected {ranks}",
            exchanges.len()
        ));
    }
    let exchanges = Arc::new(exchanges);
    Ok((0..dp)
        .map(|member| ExpertSeat {
            exchanges: exchanges.clone(),
            member,
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parcel(v: f32) -> Parcel {
        Parcel {
            rows: 1,
            values: vec![v],
            routing: Vec::new(),
        }
    }

    #[test]
    fn columns_are_dealt_in_order_the_first_members_one_more() {
        assert_eq!(deal_columns(8, 3), vec![0..3, 3..6, 6..8]);
        assert_eq!(deal_columns(2, 3), vec![0..1, 1..2, 2..2]);
        assert_eq!(deal_columns(6, 1), vec![0..6]);
    }

    #[test]
    fn every_member_gets_each_members_parcel_for_it_round_after_round() {
        let x = Arc::new(ExpertExchange::new(3));
        std::thread::scope(|s| {
            for me in 0..3 {
                let x = x.clone();
                s.spawn(move || {
                    for round in 0..50 {
                        let out = (0..3)
                            .map(|to| parcel((round * 100 + me * 10 + to) as f32))
                            .collect();
                        let got = x.all_to_all(me, out, false).unwrap();
                        assert!(!got.all_idle);
                        let want: Vec<_> = (0..3)
                            .map(|from| parcel((round * 100 + from * 10 + me) as f32))
                            .collect();
                        assert_eq!(got.parcels, want, "member {me} round {round}");
                    }
                });
            }
        });
    }

    #[test]
    fn an_idle_member_serves_until_all_are_idle() {
        let x = Arc::new(ExpertExchange::new(2));
        let rounds = std::thread::scope(|s| {
            let busy = {
                let x = x.clone();
                s.spawn(move || {
                    for _ in 0..5 {
                        let r = x.all_to_all(0, vec![parcel(1.0), parcel(2.0)], false);
                        assert!(!r.unwrap().all_idle);
                    }
                    // Done: idle like the other, and both stop on the same round.
                    x.all_to_all(0, vec![Parcel::default(); 2], true).unwrap()
                })
            };
            let mut served = 0;
            loop {
                let r = x.all_to_all(1, vec![Parcel::default(); 2], true).unwrap();
                if r.all_idle {
                    break;
                }
                assert_eq!(r.parcels[0], parcel(2.0));
                served += 1;
            }
            assert!(busy.join().unwrap().all_idle);
            served
        });
        assert_eq!(rounds, 5);
    }

    #[test]
    fn a_waiting_member_hears_a_call_from_a_busy_member_only() {
        let x = Arc::new(ExpertExchange::new(3));
        let short = Duration::from_millis(5);
        // Nobody calls: the wait times out.
        assert!(!x.wait_for_call(1, short).unwrap());
        std::thread::scope(|s| {
            // Member 2 is done: its round wakes nobody.
            let done = {
                let x = x.clone();
                s.spawn(move || x.all_to_all(2, vec![Parcel::default(); 3], true))
            };
            while x.lock().arrived == 0 {
                std::thread::yield_now();
            }
            assert!(!x.wait_for_call(1, short).unwrap());
            // Member 0 has tokens: member 1 is called (long before the timeout), joins
            // the round with nothing of its own, and gets member 0's parcel for it.
            let busy = {
                let x = x.clone();
                s.spawn(move || x.all_to_all(0, vec![parcel(0.0), parcel(1.0), parcel(2.0)], false))
            };
            assert!(x.wait_for_call(1, Duration::from_secs(600)).unwrap());
            let got = x.all_to_all(1, vec![Parcel::default(); 3], false).unwrap();
            assert!(!got.all_idle);
            assert_eq!(got.parcels[0], parcel(1.0));
            assert!(!busy.join().unwrap().unwrap().all_idle);
            assert_eq!(done.join().unwrap().unwrap().parcels[0], parcel(2.0));
        });
        // The round is over: no call waits.
        assert!(!x.wait_for_call(1, short).unwrap());
        x.leave(0, "gone");
        assert!(matches!(
            x.wait_for_call(1, short),
            Err(ExchangeError::MemberLeft { member: 0, .. })
        ));
    }

    #[test]
    fn a_member_that_leaves_fails_the_ones_waiting_on_it() {
        let x = Arc::new(ExpertExchange::new(2));
        let err = std::thread::scope(|s| {
            let waiting = {
                let x = x.clone();
                s.spawn(move || x.all_to_all(0, vec![Parcel::default(); 2], false))
            };
            x.leave(1, "a bad token");
            waiting.join().unwrap()
        });
        assert_eq!(
            err.unwrap_err(),
            ExchangeError::MemberLeft {
                member: 1,
                why: "a bad token".into()
            }
        );
        // And any later round fails at once.
        assert!(x.all_to_all(0, vec![Parcel::default(); 2], false).is_err());
    }

    #[test]
    fn misuse_is_refused() {
        let x = ExpertExchange::new(2);
        assert!(matches!(
            x.all_to_all(2, vec![Parcel::default(); 2], false),
            Err(ExchangeError::Misuse { .. })
        ));
        assert!(matches!(
            x.all_to_all(0, vec![Parcel::default(); 3], false),
            Err(ExchangeError::Misuse { .. })
        ));
    }

    #[test]
    fn seats_follow_the_dp_groups_of_the_rank_layout() {
        let seats = expert_seats(2, 1, 3).unwrap();
        assert_eq!(seats.len(), 3);
        for (d, seat) in seats.iter().enumerate() {
            assert_eq!(seat.member, d);
            assert_eq!(seat.exchanges.len(), 2);
            for t in 0..2 {
                let m = seat.member(t).unwrap();
                assert_eq!(m.exchange.members(), 3);
                let first: Arc<dyn Exchanger> = seats[0].exchanges[t].clone();
                assert!(Arc::ptr_eq(&m.exchange, &first));
            }
        }
        assert!(!Arc::ptr_eq(&seats[0].exchanges[0], &seats[0].exchanges[1]));
        // With stages, one exchange per rank of a replica, shared by the replicas.
        let staged = expert_seats(2, 2, 2).unwrap();
        assert_eq!(staged[0].exchanges.len(), 4);
        for g in 0..4 {
            assert_eq!(staged[1].member(g).unwrap().member, 1);
            for h in 0..g {
                assert!(!Arc::ptr_eq(
                    &staged[0].exchanges[g],
                    &staged[0].exchanges[h]
                ));
            }
        }
    }
}
