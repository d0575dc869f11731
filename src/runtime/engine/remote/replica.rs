//! A remote replica's side: its leading process drives its engine's handle from the
//! front's messages and sends the events of the front's requests back, in order.

use super::super::api::{Event, RequestId, Serving};
use super::wire::{ToFront, ToReplica};
use super::{Link, LinkError, POLL};
use std::collections::HashMap;
use std::sync::mpsc::{channel, Receiver, TryRecvError};
use std::sync::Arc;

/// Relays between the front (peer 0 of `link`) and `engine` until the front has closed and
/// the engine has stopped (`stopped` disconnects then). Says `Ready` first.
pub fn relay_requests(
    link: &mut dyn Link,
    engine: Arc<dyn Serving>,
    stopped: Receiver<()>,
) -> Result<(), LinkError> {
    let registry = engine.registry();
    link.send(
        0,
        &ToFront::Ready {
            info: engine.info().clone(),
        }
        .encode(),
    )?;
    let mut engine = Some(engine);
    let (events_tx, events) = channel::<(u64, Event)>();
    // The engine's id of each of the front's running requests.
    let mut ids: HashMap<u64, RequestId> = HashMap::new();
    let (mut closed, mut engine_done, mut told) = (false, false, false);
    let forward = |link: &mut dyn Link,
                   engine: &Option<Arc<dyn Serving>>,
                   ids: &mut HashMap<u64, RequestId>,
                   (id, event): (u64, Event)|
     -> Result<(), LinkError> {
        if !matches!(event, Event::Token { .. }) {
            ids.remove(&id);
        }
        let waiting = engine.as_ref().map_or(0, |e| e.load().1) as u64;
        link.send(0, &ToFront::Event { id, event, waiting }.encode())
    };
    loop {
        if let Ok(e) = events.recv_timeout(POLL) {
            forward(link, &engine, &mut ids, e)?;
            while let Ok(e) = events.try_recv() {
                forward(link, &engine, &mut ids, e)?;
            }
        }
        // Once closed and stopped nothing more is read: the front may be gone.
        while !(closed && told) {
            let Some((from, bytes)) = link.try_receive()? else {
                break;
            };
            if from != 0 {
                return Err(LinkError::Stranger { from });
            }
            match ToReplica::decode(&bytes)? {
                ToReplica::Submit { id, request } => {
                    let answer = match &engine {
                        Some(e) => {
                            let tx = events_tx.clone();
                            let sink = Box::new(move |ev| {
                                let _ = tx.send((id, ev));
                            });
                            match e.submit(request, sink) {
                                Ok(local) => {
                                    ids.insert(id, local);
                                    ToFront::Accepted { id }
                                }
                                Err(error) => ToFront::Refused { id, error },
                            }
                        }
                        None => ToFront::Refused {
                            id,
                            error: super::super::api::SubmitError::ShuttingDown,
                        },
                    };
                    link.send(0, &answer.encode())?;
                }
                ToReplica::Cancel { id } => {
                    if let (Some(e), Some(&local)) = (&engine, ids.get(&id)) {
                        e.cancel(local);
                    }
                }
                ToReplica::Drain => {
                    if let Some(e) = &engine {
                        e.drain();
                    }
                }
                ToReplica::Close => {
                    closed = true;
                    // The engine stops once its running requests end.
                    engine = None;
                }
                ToReplica::Metrics { ask } => {
                    let families = registry.gather();
                    link.send(0, &ToFront::Metrics { ask, families }.encode())?;
                }
            }
        }
        if !engine_done {
            engine_done = !matches!(stopped.try_recv(), Err(TryRecvError::Empty));
        }
        if engine_done && !told {
            // Every event the engine gave before it stopped goes first.
            while let Ok(e) = events.try_recv() {
                forward(link, &engine, &mut ids, e)?;
            }
            link.send(
                0,
                &ToFront::Stopped {
                    why: "its engine stopped".into(),
                }
                .encode(),
            )?;
            told = true;
        }
        if told && closed {
            return Ok(());
        }
    }
}
