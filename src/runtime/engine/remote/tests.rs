//! The front and the replicas' relays over channels, with stand-in engines: requests,
//! refusals, cancels, drains, load, metrics, closing, and a replica whose engine stops.

use super::super::api::*;
use super::super::metrics::Metrics;
use super::*;
use crate::runtime::sampling::Sampling;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};

/// Peer `me` of a set of channel links.
struct ChannelLink {
    me: usize,
    to: Vec<Sender<(usize, Vec<u8>)>>,
    from: Receiver<(usize, Vec<u8>)>,
}

impl Link for ChannelLink {
    fn send(&mut self, to: usize, message: &[u8]) -> Result<(), LinkError> {
        self.to[to]
            .send((self.me, message.to_vec()))
            .map_err(|_| LinkError::Transport(format!("peer {to} is gone")))
    }
    fn try_receive(&mut self) -> Result<Option<(usize, Vec<u8>)>, LinkError> {
        match self.from.try_recv() {
            Ok(m) => Ok(Some(m)),
            Err(std::sync::mpsc::TryRecvError::Empty) => Ok(None),
            Err(_) => Err(LinkError::Transport("every peer is gone".into())),
        }
    }
}

fn links(n: usize) -> Vec<ChannelLink> {
    let (to, from): (Vec<_>, Vec<_>) = (0..n).map(|_| channel()).unzip();
    from.into_iter()
        .enumerate()
        .map(|(me, from)| {
            // No sender to itself: a peer whose others are gone hears so.
            let mut to = to.clone();
            to[me] = channel().0;
            ChannelLink { me, to, from }
        })
        .collect()
}

/// What a stand-in engine was asked.
#[derive(Default)]
struct Log {
    cancelled: Vec<RequestId>,
    drained: bool,
}

/// An engine that answers a prompt at once with its tokens reversed (prompt `[-7]` is
/// refused as a full queue; `[-5]` runs until cancelled; `[-9]` stops the engine with the
/// request unfinished).
struct Fake {
    info: ModelInfo,
    log: Arc<Mutex<Log>>,
    next: Mutex<u64>,
    held: Mutex<Vec<(RequestId, EventSink)>>,
    metrics: Metrics,
    /// Dropped when the engine stops (with the last handle, or on `[-9]`).
    alive: Mutex<Option<Sender<()>>>,
}

impl Serving for Fake {
    fn info(&self) -> &ModelInfo {
        &self.info
    }
    fn submit(&self, request: GenRequest, mut sink: EventSink) -> Result<RequestId, SubmitError> {
        let mut n = self.next.lock().unwrap();
        match request.prompt[..] {
            [-7] => return Err(SubmitError::QueueFull { waiting: 3 }),
            [-9] => {
                self.alive.lock().unwrap().take();
                return Ok(99);
            }
            [-5] => {
                *n += 1;
                self.held.lock().unwrap().push((*n, sink));
                return Ok(*n);
            }
            _ => {}
        }
        for &id in request.prompt.iter().rev() {
            sink(Event::Token { id, logprobs: None });
        }
        self.metrics
            .generation_tokens
            .inc_by(request.prompt.len() as u64);
        sink(Event::Finished {
            reason: FinishReason::Length,
            usage: Usage {
                prompt_tokens: request.prompt.len(),
                completion_tokens: request.prompt.len(),
                cached_prompt_tokens: 0,
            },
        });
        *n += 1;
        Ok(*n)
    }
    fn cancel(&self, id: RequestId) {
        self.log.lock().unwrap().cancelled.push(id);
        let mut held = self.held.lock().unwrap();
        if let Some(k) = held.iter().position(|(h, _)| *h == id) {
            let (_, mut sink) = held.remove(k);
            sink(Event::Finished {
                reason: FinishReason::Cancelled,
                usage: Usage::default(),
            });
        }
    }
    fn drain(&self) {
        self.log.lock().unwrap().drained = true;
    }
    fn load(&self) -> (usize, usize) {
        (0, 0)
    }
    fn registry(&self) -> Arc<prometheus::Registry> {
        self.metrics.registry.clone()
    }
}

fn info() -> ModelInfo {
    ModelInfo {
        name: "m".into(),
        vocab: 50,
        context: 32,
    }
}

fn request(prompt: Vec<i64>) -> GenRequest {
    GenRequest {
        prompt,
        max_tokens: 4,
        min_tokens: 0,
        sampling: Sampling {
            temperature: 0.0,
            top_k: None,
            top_p: None,
            seed: 0,
        },
        stop_ids: vec![],
        logprobs: None,
    }
}

/// A sink that collects events, and where they go.
fn collector() -> (EventSink, Receiver<Event>) {
    let (tx, rx) = channel();
    (
        Box::new(move |e| {
            let _ = tx.send(e);
        }),
        rx,
    )
}

type RelayThread = std::thread::JoinHandle<Result<(), LinkError>>;

/// Starts a relay per remote replica (peers 1..=n) on threads, each over a fake engine;
/// returns the front's link, the logs and the relays' threads.
fn replicas(n: usize) -> (ChannelLink, Vec<Arc<Mutex<Log>>>, Vec<RelayThread>) {
    let mut all = links(n + 1).into_iter();
    let front = all.next().unwrap();
    let mut logs = vec![];
    let mut threads = vec![];
    for (r, mut link) in all.enumerate() {
        let log = Arc::new(Mutex::new(Log::default()));
        logs.push(log.clone());
        let (alive, stopped) = channel();
        let fake = Fake {
            info: info(),
            log,
            next: Mutex::new(100),
            held: Mutex::new(vec![]),
            metrics: Metrics::in_registry(Arc::new(prometheus::Registry::new()), Some(r + 1)),
            alive: Mutex::new(Some(alive)),
        };
        threads.push(std::thread::spawn(move || {
            relay_requests(&mut link, Arc::new(fake), stopped)
        }));
    }
    (front, logs, threads)
}

#[test]
fn requests_reach_the_remote_engines_and_their_events_come_back() {
    let (front, logs, threads) = replicas(2);
    let registry = Arc::new(prometheus::Registry::new());
    let (remotes, stops, relay) = start_front(Box::new(front), 2, &info(), registry).unwrap();
    for (k, remote) in remotes.iter().enumerate() {
        let (sink, events) = collector();
        remote.submit(request(vec![1, 2, k as i64]), sink).unwrap();
        let got: Vec<Event> = events.iter().take(4).collect();
        let tokens: Vec<i64> = got
            .iter()
            .filter_map(|e| match e {
                Event::Token { id, .. } => Some(*id),
                _ => None,
            })
            .collect();
        assert_eq!(tokens, vec![k as i64, 2, 1], "replica {}", k + 1);
        assert!(matches!(
            got[3],
            Event::Finished {
                reason: FinishReason::Length,
                ..
            }
        ));
        // The request's end reached the front before its sink heard it.
        assert_eq!(remote.load(), (0, 0));
        let (sink, _) = collector();
        assert_eq!(
            remote.submit(request(vec![-7]), sink),
            Err(SubmitError::QueueFull { waiting: 3 })
        );
        // A running request: cancelled by the front's id, which the relay turns into the
        // engine's (the fake numbers from 101: the answered one took 101).
        let (sink, events) = collector();
        let id = remote.submit(request(vec![-5]), sink).unwrap();
        assert_eq!(remote.load(), (1, 0));
        remote.cancel(id);
        assert!(matches!(
            events.recv().unwrap(),
            Event::Finished {
                reason: FinishReason::Cancelled,
                ..
            }
        ));
        assert_eq!(remote.load(), (0, 0));
        remote.drain();
    }
    // /metrics on the front lists every remote replica's figures.
    let scraped = remotes[0].registry().gather();
    let mut text = String::new();
    prometheus::TextEncoder::new()
        .encode_utf8(&scraped, &mut text)
        .unwrap();
    assert!(
        text.contains("tpc_generation_tokens_total{replica=\"1\"} 3"),
        "{text}"
    );
    assert!(
        text.contains("tpc_generation_tokens_total{replica=\"2\"} 3"),
        "{text}"
    );
    relay.close().unwrap();
    for t in threads {
        t.join().unwrap().unwrap();
    }
    for (stop, log) in stops.into_iter().zip(&logs) {
        assert!(
            stop.recv().is_err(),
            "a stopped replica's receiver disconnects"
        );
        let log = log.lock().unwrap();
        assert_eq!(log.cancelled, vec![102]);
        assert!(log.drained);
    }
    let (sink, _) = collector();
    assert!(matches!(
        remotes[1].submit(request(vec![1]), sink),
        Err(SubmitError::Stopped(_))
    ));
}

#[test]
fn a_remote_engine_that_stops_fails_its_requests_and_tells_the_front() {
    let (front, _logs, threads) = replicas(1);
    let registry = Arc::new(prometheus::Registry::new());
    let (remotes, stops, relay) = start_front(Box::new(front), 1, &info(), registry).unwrap();
    let (sink, events) = collector();
    remotes[0].submit(request(vec![-9]), sink).unwrap();
    match events.recv().unwrap() {
        Event::Failed { message } => assert!(message.contains("stopped"), "{message}"),
        e => panic!("{e:?}"),
    }
    assert!(stops[0].recv().is_err());
    assert_eq!(remotes[0].load(), (0, 0));
    relay.close().unwrap();
    for t in threads {
        t.join().unwrap().unwrap();
    }
}

#[test]
fn a_replica_serving_another_model_is_refused_at_the_start() {
    let (front, _logs, threads) = replicas(1);
    let other = ModelInfo {
        context: 16,
        ..info()
    };
    let err = start_front(Box::new(front), 1, &other, Default::default())
        .err()
        .unwrap();
    assert!(err.to_string().contains("replica 1 serves"), "{err}");
    // The relay ends when its link does (the front's side was dropped).
    let out = threads.into_iter().next().unwrap().join().unwrap();
    assert!(out.is_err());
}
