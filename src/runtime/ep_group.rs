//! The EP group of a run or a server whose replicas share their experts (`--dp D --ep`),
//! as the launchers (`replicas.rs`, the engine) see it: the seats for a plan, and which
//! replica's failure is the one to report when one stopping stops the others.

use super::error::RunError;
use super::expert_exchange::ExpertSeat;
use crate::plan::Plan;

/// The EP group's seats for `dp` replicas of `plan`, or why its experts cannot be dealt over
/// replicas.
pub(crate) fn expert_seats_for(plan: &Plan, dp: usize) -> Result<Vec<ExpertSeat>, RunError> {
    let refuse = |why: String| RunError::Replicas(format!("--ep: {why}"));
    if let Some(why) = plan.why_experts_cannot_span_replicas() {
        return Err(refuse(why.into()));
    }
    super::expert_exchange::expert_seats(plan.ranks.len(), plan.pp(), dp).map_err(refuse)
}

/// The replica whose failure to report: the first that failed of its own accord, not one
/// that only learnt that another had stopped (`--ep`); else the first that failed.
pub(crate) fn failing_replica<T>(outcomes: &[Result<T, RunError>]) -> Option<usize> {
    let echo = |e: &RunError| {
        matches!(
            e,
            RunError::ExpertExchange(super::expert_exchange::ExchangeError::MemberLeft { .. })
        )
    };
    outcomes
        .iter()
        .position(|o| o.as_ref().is_err_and(|e| !echo(e)))
        .or_else(|| outcomes.iter().position(Result::is_err))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::expert_exchange::ExchangeError;

    #[test]
    fn the_replica_reported_is_the_first_that_failed_of_its_own_accord() {
        let echo = || {
            Err(RunError::ExpertExchange(ExchangeError::MemberLeft {
                member: 2,
                why: "its rank failed".into(),
            }))
        };
        let cause = || Err(RunError::Replicas("the disk went away".into()));
        let outcomes: Vec<Result<(), RunError>> = vec![Ok(()), echo(), cause(), echo()];
        assert_eq!(failing_replica(&outcomes), Some(2));
        // Only echoes: the first of them.
        assert_eq!(failing_replica(&[Ok(()), echo(), echo()]), Some(1));
        assert_eq!(failing_replica::<()>(&[Ok(()), Ok(())]), None);
    }
}
