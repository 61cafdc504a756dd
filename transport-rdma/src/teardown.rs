//! Destroying connections' verbs objects off the runtime.
//!
//! Tearing a connection down (destroying its queue pair, completion queue
//! and `cm_id`, deregistering its memory) is system calls of milliseconds
//! each on a busy or emulated host. Run where the last reference drops (a
//! driver task, a handler), closing 2,000 connections at once in two
//! Soft-RoCE guests sharing two cores kept the runtime's workers in the
//! kernel so long that the server answered nothing for over 20 s (twice in
//! two runs); with the drops here, its slowest answer meanwhile took 1-6 s
//! (`many_connections.rs`). So those drops run on one thread of their own,
//! in the order they were handed over (a queue pair before its completion
//! queue, memory before the admission lease it was counted against).

use std::ops::{Deref, DerefMut};
use std::sync::mpsc::{self, Sender};
use std::sync::{Mutex, OnceLock};

type Garbage = Box<dyn Send>;

/// The teardown thread's queue; `None` if it could not be started (then
/// everything is dropped where it is given up).
static QUEUE: OnceLock<Option<Mutex<Sender<Garbage>>>> = OnceLock::new();

fn queue() -> Option<&'static Mutex<Sender<Garbage>>> {
    QUEUE
        .get_or_init(|| {
            let (tx, rx) = mpsc::channel::<Garbage>();
            let spawned = std::thread::Builder::new()
                .name("rdma-teardown".into())
                .spawn(move || {
                    for garbage in rx {
                        drop(garbage);
                    }
                });
            match spawned {
                Ok(_) => Some(Mutex::new(tx)),
                Err(e) => {
                    tracing::warn!("no teardown thread ({e}): connections are torn down where they are dropped");
                    None
                }
            }
        })
        .as_ref()
}

/// Drops `value` on the teardown thread, after everything handed over
/// before it.
pub(crate) fn drop_later<T: Send + 'static>(value: T) {
    let Some(queue) = queue() else {
        return drop(value);
    };
    // The thread never exits, so the send fails only if it panicked:
    // then drop here.
    let refused = queue
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .send(Box::new(value));
    drop(refused);
}

/// A `T` that is dropped on the teardown thread ([`drop_later`]); derefs
/// to it.
pub(crate) struct DropLater<T: Send + 'static>(Option<T>);

impl<T: Send + 'static> DropLater<T> {
    pub(crate) fn new(value: T) -> Self {
        Self(Some(value))
    }
}

impl<T: Send + 'static> Deref for DropLater<T> {
    type Target = T;

    fn deref(&self) -> &T {
        self.0.as_ref().expect("taken only when dropped")
    }
}

impl<T: Send + 'static> DerefMut for DropLater<T> {
    fn deref_mut(&mut self) -> &mut T {
        self.0.as_mut().expect("taken only when dropped")
    }
}

impl<T: Send + 'static> Drop for DropLater<T> {
    fn drop(&mut self) {
        if let Some(value) = self.0.take() {
            drop_later(value);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::thread::ThreadId;

    /// Records the thread it is dropped on, and its place in the order.
    struct Recorder {
        name: u32,
        drops: Arc<Mutex<Vec<(u32, ThreadId)>>>,
    }

    impl Drop for Recorder {
        fn drop(&mut self) {
            let me = std::thread::current().id();
            self.drops.lock().unwrap().push((self.name, me));
        }
    }

    #[test]
    fn values_are_dropped_on_the_teardown_thread_in_the_order_given() {
        let drops = Arc::new(Mutex::new(Vec::new()));
        let recorder = |name| Recorder {
            name,
            drops: Arc::clone(&drops),
        };
        // A tuple's fields drop in order: so do their values, there.
        drop((DropLater::new(recorder(1)), DropLater::new(recorder(2))));
        drop_later(recorder(3));
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while drops.lock().unwrap().len() < 3 {
            assert!(
                std::time::Instant::now() < deadline,
                "not all dropped in 10 s"
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let drops = drops.lock().unwrap();
        let order: Vec<u32> = drops.iter().map(|d| d.0).collect();
        assert_eq!(order, [1, 2, 3]);
        let here = std::thread::current().id();
        assert!(
            drops.iter().all(|d| d.1 != here),
            "dropped on the caller's thread: {drops:?}"
        );
    }
}
