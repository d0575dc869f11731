//! Data-parallel serving (`--dp D`): D engines, each over its own ranks and copy of the
//! weights, behind one [`Serving`]. A request goes to the replica with the least load
//! (running plus waiting) and stays there; its id says which replica holds it.

use super::api::{EventSink, GenRequest, ModelInfo, RequestId, Serving, SubmitError};
use std::sync::Arc;

/// Engines behind one front; their metrics share one registry, labelled by replica.
pub struct ReplicaSet {
    replicas: Vec<Arc<dyn Serving>>,
    registry: Arc<prometheus::Registry>,
}

impl ReplicaSet {
    /// `replicas` (at least one) serving the same model; `registry` holds every replica's
    /// metrics.
    pub fn new(replicas: Vec<Arc<dyn Serving>>, registry: Arc<prometheus::Registry>) -> Self {
        assert!(!replicas.is_empty(), "a replica set needs a replica");
        ReplicaSet { replicas, registry }
    }

    fn count(&self) -> u64 {
        self.replicas.len() as u64
    }
}

impl Serving for ReplicaSet {
    fn info(&self) -> &ModelInfo {
        self.replicas[0].info()
    }

    fn submit(&self, request: GenRequest, sink: EventSink) -> Result<RequestId, SubmitError> {
        let (r, _) = self
            .replicas
            .iter()
            .enumerate()
            .map(|(r, e)| {
                let (running, waiting) = e.load();
                (r, running + waiting)
            })
            .min_by_key(|&(r, load)| (load, r))
            .unwrap_or((0, 0));
        let inner = self.replicas[r].submit(request, sink)?;
        Ok(inner * self.count() + r as u64)
    }

    fn cancel(&self, id: RequestId) {
        let r = (id % self.count()) as usize;
        self.replicas[r].cancel(id / self.count());
    }

    fn drain(&self) {
        self.replicas.iter().for_each(|e| e.drain());
    }

    fn load(&self) -> (usize, usize) {
        self.replicas.iter().fold((0, 0), |(a, b), e| {
            let (r, w) = e.load();
            (a + r, b + w)
        })
    }

    fn registry(&self) -> Arc<prometheus::Registry> {
        self.registry.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// A replica that records what it was given and reports a fixed load.
    struct Fake {
        info: ModelInfo,
        load: (usize, usize),
        next: Mutex<u64>,
        cancelled: Mutex<Vec<u64>>,
    }

    impl Serving for Fake {
        fn info(&self) -> &ModelInfo {
            &self.info
        }
        fn submit(&self, _: GenRequest, _: EventSink) -> Result<RequestId, SubmitError> {
            let mut n = self.next.lock().unwrap();
            *n += 1;
            Ok(*n)
        }
        fn cancel(&self, id: RequestId) {
            self.cancelled.lock().unwrap().push(id);
        }
        fn drain(&self) {}
        fn load(&self) -> (usize, usize) {
            self.load
        }
        fn registry(&self) -> Arc<prometheus::Registry> {
            Default::default()
        }
    }

    #[test]
    fn requests_go_to_the_least_loaded_replica_and_cancels_follow_them() {
        let fake = |load| {
            Arc::new(Fake {
                info: ModelInfo {
                    name: "m".into(),
                    vocab: 10,
                    context: 8,
                },
                load,
                next: Mutex::new(0),
                cancelled: Mutex::new(vec![]),
            })
        };
        let (a, b, c) = (fake((3, 1)), fake((1, 0)), fake((1, 0)));
        let set = ReplicaSet::new(vec![a.clone(), b.clone(), c.clone()], Default::default());
        let request = GenRequest {
            prompt: vec![1],
            max_tokens: 1,
            min_tokens: 0,
            sampling: Default::default(),
            stop_ids: vec![],
            logprobs: None,
        };
        // b and c tie at 1; the lower index wins.
        let id = set.submit(request, Box::new(|_| {})).unwrap();
        assert_eq!(id % 3, 1);
        set.cancel(id);
        assert_eq!(*b.cancelled.lock().unwrap(), vec![id / 3]);
        assert!(a.cancelled.lock().unwrap().is_empty());
        assert_eq!(set.load(), (5, 1));
    }
}
