//! Fork-join over the items of one step (the simulator's layers): threads take the next
//! unclaimed item until none is left, so items of uneven cost (a skewed layer plans and samples
//! slower than a flat one) keep every thread busy to the end, where fixed chunks leave one
//! thread idle while the other finishes its share.

use std::sync::Mutex;

/// `f` applied to every item of `items` on up to `threads` threads (the calling thread is one
/// of them), results in item order: they do not depend on the thread count or the timing.
/// A panic in `f` propagates to the caller.
pub(crate) fn map_dynamic<I, R, F>(items: I, threads: usize, f: F) -> Vec<R>
where
    I: Iterator + Send,
    I::Item: Send,
    R: Send,
    F: Fn(I::Item) -> R + Sync,
{
    let (len, _) = items.size_hint();
    if threads <= 1 || len <= 1 {
        return items.map(f).collect();
    }
    let queue = Mutex::new(items.enumerate());
    let work = || {
        let mut done = Vec::new();
        loop {
            // The guard is dropped before `f` runs: the lock covers taking an item only.
            let next = queue.lock().unwrap_or_else(|e| e.into_inner()).next();
            let Some((i, item)) = next else {
                return done;
            };
            done.push((i, f(item)));
        }
    };
    let mut results = std::thread::scope(|scope| {
        let helpers: Vec<_> = (1..threads.min(len)).map(|_| scope.spawn(work)).collect();
        let mut results = work();
        for helper in helpers {
            match helper.join() {
                Ok(done) => results.extend(done),
                Err(panic) => std::panic::resume_unwind(panic),
            }
        }
        results
    });
    results.sort_unstable_by_key(|&(i, _)| i);
    results.into_iter().map(|(_, r)| r).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn results_keep_item_order_whatever_the_threads() {
        let mut items: Vec<u64> = (0..50).collect();
        let expected: Vec<u64> = items.iter().map(|x| x * x + 1).collect();
        for threads in [1, 2, 3, 8, 100] {
            let got = map_dynamic(items.iter_mut(), threads, |x| {
                *x += 1;
                // Uneven work: later items finish first on other threads.
                std::thread::sleep(std::time::Duration::from_micros(50 - *x % 50));
                (*x - 1) * (*x - 1) + 1
            });
            assert_eq!(got, expected, "{threads} threads");
            items.iter_mut().for_each(|x| *x -= 1);
        }
        assert!(map_dynamic(Vec::<u8>::new().into_iter(), 4, |x| x).is_empty());
    }
}
