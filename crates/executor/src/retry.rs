//! The one retry policy of a query: how often and how patiently a failing call
//! to the source, the offset store or the sink is tried again, how long a part
//! that has never answered is given at the start, and how a stop request cuts
//! the waiting short. The clients make one attempt per call; every retry is
//! counted here.

use std::fmt::Display;
use std::future::Future;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

/// How often, and how patiently, a transient failure of the source, the offset
/// store or the sink is retried before the query stops.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Attempts in all, the first included (1 means no retry).
    pub max_attempts: u32,
    /// The wait before the first retry; it doubles with every further one.
    pub initial_backoff: Duration,
    /// The longest wait between two attempts.
    pub max_backoff: Duration,
    /// How long the retries of a part that has not answered once since the
    /// start may take in all, attempts included: a server that is unreachable
    /// or misnamed at start fails the query within this time.
    pub startup_timeout: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_attempts: 10,
            initial_backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(30),
            startup_timeout: Duration::from_secs(60),
        }
    }
}

impl RetryPolicy {
    /// The wait before attempt `attempt` (2 for the first retry).
    fn backoff(&self, attempt: u32) -> Duration {
        let doublings = attempt.saturating_sub(2).min(20);
        self.initial_backoff
            .saturating_mul(1 << doublings)
            .min(self.max_backoff)
    }
}

/// Why the retries of a call were given up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GaveUp {
    /// `max_attempts` attempts failed.
    Attempts,
    /// The part had not answered once since the start, and `startup_timeout`
    /// passed.
    StartupTimeout(Duration),
}

impl Display for GaveUp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GaveUp::Attempts => f.write_str("retry.max_attempts"),
            GaveUp::StartupTimeout(limit) => write!(
                f,
                "retry.startup_timeout ({}), as it has not answered since the start",
                humantime::format_duration(*limit)
            ),
        }
    }
}

/// The part of a query a call goes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Part {
    Source,
    Store,
    Sink,
}

/// Which parts have answered at least once in this run.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Reached {
    source: bool,
    store: bool,
    sink: bool,
}

impl Reached {
    pub(crate) fn get(&self, part: Part) -> bool {
        match part {
            Part::Source => self.source,
            Part::Store => self.store,
            Part::Sink => self.sink,
        }
    }

    pub(crate) fn mark(&mut self, part: Part) {
        match part {
            Part::Source => self.source = true,
            Part::Store => self.store = true,
            Part::Sink => self.sink = true,
        }
    }
}

/// How one attempt ended.
enum Attempt<T> {
    /// The call returned.
    Done(T),
    /// A stop was requested while it was allowed to cut the attempt short.
    Stopped,
    /// The startup timeout passed before the call returned.
    TimedOut,
}

/// What to do after a failed attempt.
enum Next {
    /// Try again: the wait is over.
    Retry,
    /// The error is permanent: report it as it is.
    Permanent,
    /// The retries are spent.
    GiveUp(GaveUp),
    /// A stop was requested during the wait.
    Stopped,
}

/// The tries of one call under the policy.
pub(crate) struct Tries {
    policy: RetryPolicy,
    what: &'static str,
    started: Instant,
    attempt: u32,
    /// Set when the part has never answered: the end of its startup time.
    deadline: Option<Instant>,
    /// Inside a batch, a stop request lets the first attempt finish, as the
    /// batch is finished first; outside one, and once a batch is retrying, it
    /// ends the call at once (the durable plan makes that safe).
    in_batch: bool,
}

impl Tries {
    pub(crate) fn new(
        policy: RetryPolicy,
        what: &'static str,
        reached: bool,
        in_batch: bool,
    ) -> Self {
        let started = Instant::now();
        Tries {
            policy,
            what,
            started,
            attempt: 1,
            deadline: (!reached).then(|| started + policy.startup_timeout),
            in_batch,
        }
    }

    /// Attempts made so far, the current one included.
    pub(crate) fn attempts(&self) -> u32 {
        self.attempt
    }

    /// Time since the first attempt began.
    pub(crate) fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    /// What is being tried, for messages.
    pub(crate) fn what(&self) -> &'static str {
        self.what
    }

    /// Runs one attempt, unless a stop request or the startup timeout ends it.
    async fn attempt<F: Future>(
        &self,
        stop: &mut watch::Receiver<bool>,
        call: F,
    ) -> Attempt<F::Output> {
        let interruptible = !self.in_batch || self.attempt > 1;
        tokio::select! {
            biased;
            out = call => Attempt::Done(out),
            () = stop_requested(stop), if interruptible => Attempt::Stopped,
            () = sleep_until(self.deadline) => Attempt::TimedOut,
        }
    }

    /// After a failed attempt: waits for the next one, or says why not. The
    /// wait is logged with the error, and ends early on a stop request.
    async fn after_failure(
        &mut self,
        stop: &mut watch::Receiver<bool>,
        transient: bool,
        error: &(dyn Display + Sync),
    ) -> Next {
        if !transient {
            return Next::Permanent;
        }
        if self.attempt >= self.policy.max_attempts.max(1) {
            return Next::GiveUp(GaveUp::Attempts);
        }
        let wait = self.policy.backoff(self.attempt + 1);
        let wake = Instant::now() + wait;
        if let Some(deadline) = self.deadline
            && wake >= deadline
        {
            return Next::GiveUp(GaveUp::StartupTimeout(self.policy.startup_timeout));
        }
        self.attempt += 1;
        tracing::warn!(
            %error,
            attempt = self.attempt,
            max_attempts = self.policy.max_attempts,
            wait_ms = wait.as_millis() as u64,
            "{} failed; retrying",
            self.what
        );
        tokio::select! {
            biased;
            () = stop_requested(stop) => Next::Stopped,
            () = tokio::time::sleep_until(wake) => Next::Retry,
        }
    }

    /// Why a timed-out attempt ended the tries.
    pub(crate) fn timed_out(&self) -> GaveUp {
        GaveUp::StartupTimeout(self.policy.startup_timeout)
    }
}

/// How a driven call ended without a value.
pub(crate) enum Failed<E> {
    /// It failed for good: a permanent error, or the last one when the retries
    /// were given up (`why`).
    Error {
        /// The last error.
        error: E,
        /// Why no further attempt was made; `None` for a permanent error.
        why: Option<GaveUp>,
    },
    /// The startup timeout cut an attempt short; the error before it, if any.
    TimedOut {
        /// The error of the attempt before.
        last: Option<E>,
    },
    /// A stop request ended the retrying.
    Stopped,
}

/// The one retry driver: every call to a part of the query that may fail
/// transiently is made through one, by [`drive!`], so that one policy decides
/// how often and how patiently it is tried again, and nothing else in the
/// executor loops over a failing call. The clients make one attempt per call.
pub(crate) struct Driver<E> {
    tries: Tries,
    /// Its own handle on the stop request, so that the call may borrow the
    /// query while the driver waits on it.
    stop: watch::Receiver<bool>,
    /// Which errors are worth another attempt: the part's own judgement.
    retryable: fn(&E) -> bool,
    /// The error of the attempt before, for a timeout's report.
    last: Option<E>,
}

impl<E: Display + Sync> Driver<E> {
    /// A driver for the tries of one call.
    pub(crate) fn new(
        tries: Tries,
        stop: watch::Receiver<bool>,
        retryable: fn(&E) -> bool,
    ) -> Self {
        Driver {
            tries,
            stop,
            retryable,
            last: None,
        }
    }

    /// Runs one attempt, and after a failure the wait before the next: the
    /// call's outcome, or `None` when it is to be made again.
    pub(crate) async fn attempt<T>(
        &mut self,
        call: impl Future<Output = Result<T, E>>,
    ) -> Option<Result<T, Failed<E>>> {
        let error = match self.tries.attempt(&mut self.stop, call).await {
            Attempt::Done(Ok(value)) => return Some(Ok(value)),
            Attempt::Done(Err(error)) => error,
            Attempt::Stopped => return Some(Err(Failed::Stopped)),
            Attempt::TimedOut => {
                return Some(Err(Failed::TimedOut {
                    last: self.last.take(),
                }));
            }
        };
        let retryable = (self.retryable)(&error);
        match self
            .tries
            .after_failure(&mut self.stop, retryable, &error)
            .await
        {
            Next::Retry => {
                self.last = Some(error);
                None
            }
            Next::Permanent => Some(Err(Failed::Error { error, why: None })),
            Next::GiveUp(why) => Some(Err(Failed::Error {
                error,
                why: Some(why),
            })),
            Next::Stopped => Some(Err(Failed::Stopped)),
        }
    }

    /// The tries made, for a report of why they ended.
    pub(crate) fn tries(&self) -> &Tries {
        &self.tries
    }
}

/// Makes the call `$call` (an expression making a fresh future, evaluated for
/// each attempt) through the [`Driver`] `$driver` until it has an outcome.
macro_rules! drive {
    ($driver:expr, $call:expr) => {{
        let driver = &mut $driver;
        loop {
            if let Some(outcome) = driver.attempt($call).await {
                break outcome;
            }
        }
    }};
}

/// Resolves once a stop is requested; never if the sender is gone.
async fn stop_requested(stop: &mut watch::Receiver<bool>) {
    if stop.wait_for(|stop| *stop).await.is_err() {
        std::future::pending::<()>().await;
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> RetryPolicy {
        RetryPolicy {
            max_attempts: 10,
            initial_backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(30),
            startup_timeout: Duration::from_secs(60),
        }
    }

    #[test]
    fn backoff_doubles_up_to_its_ceiling() {
        let p = policy();
        let waits: Vec<u64> = (2..=8).map(|a| p.backoff(a).as_secs()).collect();
        assert_eq!(waits, [1, 2, 4, 8, 16, 30, 30]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_part_never_reached_gives_up_before_its_startup_timeout() {
        let (_tx, mut stop) = watch::channel(false);
        let mut tries = Tries::new(policy(), "discovering partitions", false, false);
        let mut outcome = None;
        for _ in 0..20 {
            // Each attempt fails after 20 s, as a request to an unreachable broker does.
            match tries
                .attempt(&mut stop, tokio::time::sleep(Duration::from_secs(20)))
                .await
            {
                Attempt::Done(()) => {}
                Attempt::TimedOut => {
                    outcome = Some("timed out");
                    break;
                }
                Attempt::Stopped => unreachable!("nobody asked to stop"),
            }
            if let Next::GiveUp(GaveUp::StartupTimeout(_)) =
                tries.after_failure(&mut stop, true, &"unreachable").await
            {
                outcome = Some("gave up");
                break;
            }
        }
        // Attempts at 0-20 s and 21-41 s fail; the third, from 43 s, is cut
        // off by the 60 s startup timeout before it could fail at 63 s.
        assert_eq!(outcome, Some("timed out"));
        assert_eq!(tries.elapsed(), Duration::from_secs(60));
        assert_eq!(tries.attempts(), 3);
    }

    #[tokio::test(start_paused = true)]
    async fn a_part_that_answered_before_retries_max_attempts_times() {
        let (_tx, mut stop) = watch::channel(false);
        let mut tries = Tries::new(policy(), "reading", true, false);
        let next = loop {
            match tries.after_failure(&mut stop, true, &"down").await {
                Next::Retry => continue,
                other => break other,
            }
        };
        assert!(matches!(next, Next::GiveUp(GaveUp::Attempts)));
        assert_eq!(tries.attempts(), 10);
        // 1 + 2 + 4 + 8 + 16 + 30 + 30 + 30 + 30 seconds of backoff.
        assert_eq!(tries.elapsed().as_secs(), 151);
    }

    #[tokio::test(start_paused = true)]
    async fn a_stop_request_ends_a_wait_and_an_attempt_outside_a_batch() {
        let (tx, mut stop) = watch::channel(false);
        let mut tries = Tries::new(policy(), "discovering partitions", true, false);
        let waiting = tokio::spawn(async move {
            let next = tries.after_failure(&mut stop, true, &"down").await;
            let next = match next {
                Next::Stopped => "stopped",
                _ => "went on",
            };
            let attempt = tries.attempt(&mut stop, std::future::pending::<()>()).await;
            (next, matches!(attempt, Attempt::Stopped))
        });
        tokio::task::yield_now().await;
        tx.send(true).unwrap();
        assert_eq!(waiting.await.unwrap(), ("stopped", true));
    }

    #[tokio::test(start_paused = true)]
    async fn inside_a_batch_the_first_attempt_is_finished_despite_a_stop() {
        let (tx, mut stop) = watch::channel(true);
        let tries = Tries::new(policy(), "writing the commit", true, true);
        let attempt = tries
            .attempt(&mut stop, tokio::time::sleep(Duration::from_secs(5)))
            .await;
        assert!(matches!(attempt, Attempt::Done(())));
        drop(tx);
    }

    #[tokio::test(start_paused = true)]
    async fn permanent_errors_are_not_retried() {
        let (_tx, mut stop) = watch::channel(false);
        let mut tries = Tries::new(policy(), "loading", true, false);
        assert!(matches!(
            tries.after_failure(&mut stop, false, &"bad").await,
            Next::Permanent
        ));
        assert_eq!(tries.attempts(), 1);
    }
}
