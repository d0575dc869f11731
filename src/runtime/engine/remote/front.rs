//! The front's side: a [`RemoteReplica`] per replica in another process, and the relay
//! thread that alone uses the link — it sends what the remote replicas queue and hands
//! what arrives to the requests' sinks, the waiting submissions and metric scrapes.

use super::super::api::{Event, EventSink, GenRequest, ModelInfo, RequestId, Serving, SubmitError};
use super::wire::{ToFront, ToReplica};
use super::{Link, LinkError, POLL};
use prometheus::proto::MetricFamily;
use std::collections::HashMap;
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// How long a `/metrics` scrape waits for a replica's figures before it leaves them out.
const METRICS_WAIT: Duration = Duration::from_secs(5);

/// What the relay thread is asked to do.
enum Out {
    Send(usize, ToReplica),
    /// Tell every replica the front is done, and end once each has stopped.
    Close,
}

/// One remote replica as the front tracks it.
struct Peer {
    /// Requests submitted and not yet finished.
    in_flight: usize,
    /// Requests waiting in its engine, as it last said.
    waiting: usize,
    stopped: Option<String>,
    /// Dropped when it stops: its receiver tells the server.
    stop: Option<Sender<()>>,
}

#[derive(Default)]
struct State {
    next_id: u64,
    sinks: HashMap<u64, (usize, EventSink)>,
    acks: HashMap<u64, (usize, Sender<Result<(), SubmitError>>)>,
    asks: HashMap<u64, Sender<Vec<MetricFamily>>>,
    /// By peer number; 0 (the front itself) is never used.
    peers: Vec<Option<Peer>>,
}

impl State {
    fn peer(&mut self, p: usize) -> Option<&mut Peer> {
        self.peers.get_mut(p).and_then(|x| x.as_mut())
    }

    fn next(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    /// Peer `p` has stopped (`why`): its submissions are refused and its requests failed.
    fn stopped(&mut self, p: usize, why: String) {
        let Some(peer) = self.peer(p) else { return };
        peer.in_flight = 0;
        peer.waiting = 0;
        peer.stop = None;
        peer.stopped.get_or_insert(why.clone());
        for id in ids_of(&self.sinks, p) {
            if let Some((_, mut sink)) = self.sinks.remove(&id) {
                sink(Event::Failed {
                    message: format!("the engine has stopped: {why}"),
                });
            }
        }
        for id in ids_of(&self.acks, p) {
            if let Some((_, tx)) = self.acks.remove(&id) {
                let _ = tx.send(Err(SubmitError::Stopped(why.clone())));
            }
        }
    }
}

/// The requests of `map` that went to peer `p`.
fn ids_of<V>(map: &HashMap<u64, (usize, V)>, p: usize) -> Vec<u64> {
    map.iter()
        .filter(|(_, (q, _))| *q == p)
        .map(|(&id, _)| id)
        .collect()
}

struct Shared {
    state: Mutex<State>,
    out: Mutex<Sender<Out>>,
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, State> {
        // A sink that panicked poisons nothing the front relies on.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn send(&self, out: Out) -> bool {
        self.out
            .lock()
            .map(|tx| tx.send(out).is_ok())
            .unwrap_or(false)
    }
}

/// A replica whose engine runs in another process, as a [`Serving`].
pub struct RemoteReplica {
    peer: usize,
    info: ModelInfo,
    shared: Arc<Shared>,
    registry: Arc<prometheus::Registry>,
}

impl Serving for RemoteReplica {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn submit(&self, request: GenRequest, sink: EventSink) -> Result<RequestId, SubmitError> {
        let (tx, rx) = channel();
        let id = {
            let mut st = self.shared.state();
            let peer = self.peer;
            match st.peer(peer) {
                Some(p) => {
                    if let Some(why) = &p.stopped {
                        return Err(SubmitError::Stopped(why.clone()));
                    }
                    p.in_flight += 1;
                }
                None => return Err(SubmitError::Stopped("no such replica".into())),
            }
            let id = st.next();
            st.sinks.insert(id, (peer, sink));
            st.acks.insert(id, (peer, tx));
            id
        };
        let gone = || SubmitError::Stopped(format!("the link to replica {} is gone", self.peer));
        if !self
            .shared
            .send(Out::Send(self.peer, ToReplica::Submit { id, request }))
        {
            let mut st = self.shared.state();
            st.sinks.remove(&id);
            st.acks.remove(&id);
            return Err(gone());
        }
        // The relay answers every submission: accepted, refused, or the replica stopped.
        match rx.recv() {
            Ok(Ok(())) => Ok(id),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(gone()),
        }
    }

    fn cancel(&self, id: RequestId) {
        self.shared
            .send(Out::Send(self.peer, ToReplica::Cancel { id }));
    }

    fn drain(&self) {
        self.shared.send(Out::Send(self.peer, ToReplica::Drain));
    }

    fn load(&self) -> (usize, usize) {
        let mut st = self.shared.state();
        match st.peer(self.peer) {
            Some(p) => {
                let waiting = p.waiting.min(p.in_flight);
                (p.in_flight - waiting, waiting)
            }
            None => (0, 0),
        }
    }

    fn registry(&self) -> Arc<prometheus::Registry> {
        self.registry.clone()
    }
}

/// Scrapes the remote replicas' metrics into the front's registry.
struct RemoteMetrics {
    shared: Arc<Shared>,
}

impl prometheus::core::Collector for RemoteMetrics {
    fn desc(&self) -> Vec<&prometheus::core::Desc> {
        Vec::new()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let asked: Vec<Receiver<Vec<MetricFamily>>> = {
            let mut st = self.shared.state();
            let live: Vec<usize> = (0..st.peers.len())
                .filter(|&p| st.peers[p].as_ref().is_some_and(|x| x.stopped.is_none()))
                .collect();
            live.into_iter()
                .filter_map(|p| {
                    let (tx, rx) = channel();
                    let ask = st.next();
                    st.asks.insert(ask, tx);
                    self.shared
                        .send(Out::Send(p, ToReplica::Metrics { ask }))
                        .then_some(rx)
                })
                .collect()
        };
        asked
            .into_iter()
            .filter_map(|rx| rx.recv_timeout(METRICS_WAIT).ok())
            .flatten()
            .collect()
    }
}

/// The running relay of a front; [`FrontRelay::close`] ends it.
pub struct FrontRelay {
    out: Sender<Out>,
    thread: std::thread::JoinHandle<Result<(), LinkError>>,
}

impl FrontRelay {
    /// Tells every replica the front is done and waits until each has stopped (their
    /// engines end once their running requests have).
    pub fn close(self) -> Result<(), LinkError> {
        let _ = self.out.send(Out::Close);
        self.thread
            .join()
            .unwrap_or_else(|_| Err(LinkError::Transport("the front's relay panicked".into())))
    }
}

/// Waits until each of the `replicas` peers (1 to `replicas`) over `link` has loaded, checks
/// that it serves `info`, and starts the relay. Returns a [`Serving`] per remote replica
/// (their metrics scraped into `registry`), a receiver per remote replica that disconnects
/// when it stops, and the relay.
#[allow(clippy::type_complexity)]
pub fn start_front(
    mut link: Box<dyn Link>,
    replicas: usize,
    info: &ModelInfo,
    registry: Arc<prometheus::Registry>,
) -> Result<(Vec<Arc<RemoteReplica>>, Vec<Receiver<()>>, FrontRelay), LinkError> {
    let mut ready = vec![false; replicas + 1];
    ready[0] = true;
    while ready.iter().any(|r| !r) {
        let Some((from, bytes)) = link.try_receive()? else {
            std::thread::sleep(POLL);
            continue;
        };
        match (ToFront::decode(&bytes)?, ready.get_mut(from)) {
            (ToFront::Ready { info: theirs }, Some(r)) if !*r => {
                if theirs != *info {
                    return Err(LinkError::OtherModel {
                        replica: from,
                        theirs: format!("{theirs:?}"),
                        ours: format!("{info:?}"),
                    });
                }
                *r = true;
            }
            _ => return Err(LinkError::Stranger { from }),
        }
    }
    let (out, out_rx) = channel();
    let mut stops = Vec::with_capacity(replicas);
    let mut state = State::default();
    state.peers.push(None);
    for _ in 0..replicas {
        let (tx, rx) = channel();
        stops.push(rx);
        state.peers.push(Some(Peer {
            in_flight: 0,
            waiting: 0,
            stopped: None,
            stop: Some(tx),
        }));
    }
    let shared = Arc::new(Shared {
        state: Mutex::new(state),
        out: Mutex::new(out.clone()),
    });
    // An empty description registers once, and a second front's would be refused: there is
    // one front per process.
    let _ = registry.register(Box::new(RemoteMetrics {
        shared: shared.clone(),
    }));
    let remotes = (1..=replicas)
        .map(|peer| {
            Arc::new(RemoteReplica {
                peer,
                info: info.clone(),
                shared: shared.clone(),
                registry: registry.clone(),
            })
        })
        .collect();
    let relay_shared = shared.clone();
    let thread = std::thread::Builder::new()
        .name("tpc-front-relay".into())
        .spawn(move || {
            let guard = StopAllOnExit(relay_shared.clone());
            let out = relay(link.as_mut(), &relay_shared, &out_rx);
            if let Err(e) = &out {
                let mut st = relay_shared.state();
                for p in 1..st.peers.len() {
                    st.stopped(p, e.to_string());
                }
            }
            drop(guard);
            out
        })
        .map_err(|e| LinkError::Transport(format!("cannot start the front's relay: {e}")))?;
    Ok((remotes, stops, FrontRelay { out, thread }))
}

/// However the relay ends (a panic too), no submission waits for it and no request stays
/// open: every replica not yet stopped counts as stopped.
struct StopAllOnExit(Arc<Shared>);

impl Drop for StopAllOnExit {
    fn drop(&mut self) {
        let mut st = self.0.state();
        for p in 1..st.peers.len() {
            st.stopped(p, "the front's relay has ended".into());
        }
    }
}

/// The relay's loop: until closed and every replica has stopped.
fn relay(link: &mut dyn Link, shared: &Shared, out: &Receiver<Out>) -> Result<(), LinkError> {
    let mut closing = false;
    loop {
        let mut next = match out.recv_timeout(POLL) {
            Ok(o) => Some(o),
            Err(RecvTimeoutError::Timeout) => None,
            // Every sender gone without a close: close (and wait as a timeout would, so
            // the loop does not spin while the replicas stop).
            Err(RecvTimeoutError::Disconnected) => {
                std::thread::sleep(POLL);
                Some(Out::Close)
            }
        };
        while let Some(o) = next.take() {
            match o {
                Out::Send(to, m) => link.send(to, &m.encode())?,
                Out::Close if !closing => {
                    closing = true;
                    let peers = shared.state().peers.len();
                    for p in 1..peers {
                        link.send(p, &ToReplica::Close.encode())?;
                    }
                }
                Out::Close => {}
            }
            next = out.try_recv().ok();
        }
        // Once closed, the relay ends as soon as every replica has stopped: nothing more
        // comes, and a link may report the peers gone after their last message.
        let done = || {
            closing
                && shared
                    .state()
                    .peers
                    .iter()
                    .flatten()
                    .all(|p| p.stopped.is_some())
        };
        while !done() {
            let Some((from, bytes)) = link.try_receive()? else {
                break;
            };
            deliver(shared, from, ToFront::decode(&bytes)?)?;
        }
        if done() {
            return Ok(());
        }
    }
}

/// Hands what peer `from` said to whoever waits for it.
fn deliver(shared: &Shared, from: usize, message: ToFront) -> Result<(), LinkError> {
    let mut st = shared.state();
    if st.peer(from).is_none() {
        return Err(LinkError::Stranger { from });
    }
    match message {
        ToFront::Accepted { id } => {
            if let Some((_, tx)) = st.acks.remove(&id) {
                let _ = tx.send(Ok(()));
            }
        }
        ToFront::Refused { id, error } => {
            st.sinks.remove(&id);
            if let Some(p) = st.peer(from) {
                p.in_flight = p.in_flight.saturating_sub(1);
            }
            if let Some((_, tx)) = st.acks.remove(&id) {
                let _ = tx.send(Err(error));
            }
        }
        ToFront::Event { id, event, waiting } => {
            let last = !matches!(event, Event::Token { .. });
            let known = st.sinks.contains_key(&id);
            if let Some(p) = st.peer(from) {
                p.waiting = usize::try_from(waiting).unwrap_or(usize::MAX);
                if last && known {
                    p.in_flight = p.in_flight.saturating_sub(1);
                }
            }
            if last {
                if let Some((_, mut sink)) = st.sinks.remove(&id) {
                    sink(event);
                }
            } else if let Some((_, sink)) = st.sinks.get_mut(&id) {
                sink(event);
            }
        }
        ToFront::Metrics { ask, families } => {
            if let Some(tx) = st.asks.remove(&ask) {
                let _ = tx.send(families);
            }
        }
        ToFront::Stopped { why } => st.stopped(from, why),
        ToFront::Ready { .. } => {
            return Err(LinkError::Corrupt {
                what: "a message from a replica",
                problem: format!("replica {from} said it was ready twice"),
            })
        }
    }
    Ok(())
}
