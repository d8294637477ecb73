//! How a completion wait pauses between status polls: a few polls back to back (a batch that
//! is about to finish is seen at once), then a few that yield the core, then sleeps growing
//! from [`FIRST_SLEEP`] to [`LONGEST_SLEEP`], so that a long wait leaves the host's cores to
//! the copies and the engine's own threads instead of spinning on the status call.

use std::time::{Duration, Instant};

/// Polls made back to back before the first yield.
pub(crate) const SPINS: u32 = 8;
/// Polls that yield the core before the first sleep.
pub(crate) const YIELDS: u32 = 8;
/// The first sleep between polls; each next one doubles, up to [`LONGEST_SLEEP`].
pub(crate) const FIRST_SLEEP: Duration = Duration::from_micros(20);
/// The longest sleep between polls: the most a wait can add after its batch completed.
pub(crate) const LONGEST_SLEEP: Duration = Duration::from_millis(1);

/// What to do before the next poll.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pause {
    /// Poll again at once (a CPU spin hint in between).
    Spin,
    /// Give the core to another thread, then poll.
    Yield,
    /// Sleep this long, then poll.
    Sleep(Duration),
}

/// The pauses of one wait, in order.
#[derive(Debug, Default)]
pub(crate) struct Backoff {
    polls: u32,
    sleep: Option<Duration>,
}

impl Backoff {
    /// The pause before the next poll.
    pub(crate) fn next_pause(&mut self) -> Pause {
        self.polls = self.polls.saturating_add(1);
        if self.polls <= SPINS {
            return Pause::Spin;
        }
        if self.polls <= SPINS + YIELDS {
            return Pause::Yield;
        }
        let sleep = self
            .sleep
            .map_or(FIRST_SLEEP, |s| (s * 2).min(LONGEST_SLEEP));
        self.sleep = Some(sleep);
        Pause::Sleep(sleep)
    }

    /// Pauses before the next poll; a sleep never runs past `deadline`, so a wait's timeout
    /// is seen when it falls due.
    pub(crate) fn pause(&mut self, deadline: Instant) {
        match self.next_pause() {
            Pause::Spin => std::hint::spin_loop(),
            Pause::Yield => std::thread::yield_now(),
            Pause::Sleep(sleep) => {
                let left = deadline.saturating_duration_since(Instant::now());
                // Past the deadline the caller's next check reports the timeout.
                std::thread::sleep(sleep.min(left));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spins_then_yields_then_sleeps_growing_to_the_cap() {
        let mut backoff = Backoff::default();
        let pauses: Vec<Pause> = (0..40).map(|_| backoff.next_pause()).collect();
        let spins = SPINS as usize;
        let yields = YIELDS as usize;
        assert!(pauses[..spins].iter().all(|&p| p == Pause::Spin));
        assert!(
            pauses[spins..spins + yields]
                .iter()
                .all(|&p| p == Pause::Yield)
        );
        let sleeps: Vec<Duration> = pauses[spins + yields..]
            .iter()
            .map(|&p| match p {
                Pause::Sleep(d) => d,
                other => panic!("expected a sleep, got {other:?}"),
            })
            .collect();
        assert_eq!(sleeps[0], FIRST_SLEEP);
        assert_eq!(sleeps[1], FIRST_SLEEP * 2);
        assert!(sleeps.windows(2).all(|w| w[0] <= w[1]));
        assert!(sleeps.iter().all(|&d| d <= LONGEST_SLEEP));
        assert_eq!(*sleeps.last().expect("sleeps"), LONGEST_SLEEP);
    }

    #[test]
    fn a_sleep_stops_at_the_deadline() {
        let mut backoff = Backoff {
            polls: SPINS + YIELDS,
            sleep: Some(LONGEST_SLEEP),
        };
        // A deadline already past: the pause returns without sleeping its millisecond out.
        // (No timing is asserted; the call must simply return.)
        backoff.pause(Instant::now());
        assert_eq!(backoff.next_pause(), Pause::Sleep(LONGEST_SLEEP));
    }
}
