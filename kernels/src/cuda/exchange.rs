//! The all-to-all between ranks whose buffers share one GPU: each destination's segments of
//! every sender's send buffer copied device to device into one receive buffer, sender after
//! sender (dispatch), and the outputs copied back into each sender's send layout (combine).

use super::permute::DeviceDispatch;
use super::{CudaError, Gpu};
use crate::permute::remote_recv_bytes;
use cudarc::driver::CudaSlice;

/// Everything one destination rank received, concatenated in sender order.
pub(crate) struct ReceivedRows {
    pub rows: CudaSlice<f32>,
    pub experts: CudaSlice<u32>,
    pub instances: CudaSlice<u32>,
    pub len: usize,
}

/// Who sends how many rows to whom: `counts[src][dst]` and where each sender's segment starts
/// in its destination's receive buffer.
pub(crate) struct Exchange {
    counts: Vec<Vec<usize>>,
    /// `recv_offsets[dst][src]`: first row of `src`'s segment in `dst`'s receive buffer.
    recv_offsets: Vec<Vec<usize>>,
}

impl Exchange {
    pub(crate) fn new(dispatches: &[Option<DeviceDispatch>], ranks: usize) -> Self {
        Self::from_counts(
            dispatches
                .iter()
                .map(|d| match d {
                    Some(d) => d
                        .dest_offsets
                        .windows(2)
                        .map(|w| (w[1] - w[0]) as usize)
                        .collect(),
                    None => vec![0; ranks],
                })
                .collect(),
        )
    }

    /// From `counts[src][dst]`, rows each source sends each destination (a square matrix).
    fn from_counts(counts: Vec<Vec<usize>>) -> Self {
        let ranks = counts.len();
        let recv_offsets = (0..ranks)
            .map(|dst| {
                counts
                    .iter()
                    .scan(0usize, |next, row| {
                        let at = *next;
                        *next += row[dst];
                        Some(at)
                    })
                    .collect()
            })
            .collect();
        Self {
            counts,
            recv_offsets,
        }
    }

    /// Rows `dst` receives in total.
    fn received(&self, dst: usize) -> usize {
        self.counts.iter().map(|row| row[dst]).sum()
    }

    /// Dispatch: `dst`'s segments of every sender copied into one receive buffer.
    pub(crate) fn gather(
        &self,
        gpu: &Gpu,
        dispatches: &[Option<DeviceDispatch>],
        dst: usize,
        hidden: usize,
    ) -> Result<Option<ReceivedRows>, CudaError> {
        let len = self.received(dst);
        if len == 0 {
            return Ok(None);
        }
        let s = gpu.stream();
        let mut out = ReceivedRows {
            rows: s.alloc_zeros(len * hidden)?,
            experts: s.alloc_zeros(len)?,
            instances: s.alloc_zeros(len)?,
            len,
        };
        for (src, d) in dispatches.iter().enumerate() {
            let (Some(d), n) = (d, self.counts[src][dst]) else {
                continue;
            };
            if n == 0 {
                continue;
            }
            let from = d.dest_offsets[dst] as usize;
            let to = self.recv_offsets[dst][src];
            s.memcpy_dtod(
                &d.rows.slice(from * hidden..(from + n) * hidden),
                &mut out.rows.slice_mut(to * hidden..(to + n) * hidden),
            )?;
            s.memcpy_dtod(
                &d.experts.slice(from..from + n),
                &mut out.experts.slice_mut(to..to + n),
            )?;
            s.memcpy_dtod(
                &d.instances.slice(from..from + n),
                &mut out.instances.slice_mut(to..to + n),
            )?;
        }
        Ok(Some(out))
    }

    /// Combine's all-to-all: `src`'s outputs from every destination, in its send layout.
    pub(crate) fn scatter_back(
        &self,
        gpu: &Gpu,
        computed: &[Option<CudaSlice<f32>>],
        dispatch: &DeviceDispatch,
        src: usize,
        hidden: usize,
    ) -> Result<CudaSlice<f32>, CudaError> {
        let s = gpu.stream();
        let mut back = s.alloc_zeros::<f32>(dispatch.len() * hidden)?;
        for (dst, outputs) in computed.iter().enumerate() {
            let n = self.counts[src][dst];
            let (Some(outputs), true) = (outputs, n > 0) else {
                continue;
            };
            let from = self.recv_offsets[dst][src];
            let to = dispatch.dest_offsets[dst] as usize;
            s.memcpy_dtod(
                &outputs.slice(from * hidden..(from + n) * hidden),
                &mut back.slice_mut(to * hidden..(to + n) * hidden),
            )?;
        }
        Ok(back)
    }

    /// Per rank: bytes received from other ranks (dispatched rows with their ids, returned rows).
    pub(crate) fn remote_bytes(&self, hidden: usize) -> Vec<u64> {
        (0..self.counts.len())
            .map(|rank| {
                let rows_from: Vec<usize> = self.counts.iter().map(|row| row[rank]).collect();
                remote_recv_bytes(rank, &rows_from, &self.counts[rank], hidden)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exchange_places_senders_in_order_and_counts_remote_bytes() {
        // counts[src][dst]
        let ex = Exchange::from_counts(vec![vec![2, 3, 0], vec![0, 1, 4], vec![5, 0, 6]]);
        assert_eq!(ex.received(0), 7);
        assert_eq!(ex.received(1), 4);
        assert_eq!(ex.received(2), 10);
        // Destination 2 receives rank 0's 0 rows at 0, rank 1's 4 at 0, rank 2's 6 at 4.
        assert_eq!(ex.recv_offsets[2], vec![0, 0, 4]);
        assert_eq!(ex.recv_offsets[0], vec![0, 2, 2]);
        let hidden = 4;
        let (row, ids) = (16u64, 12u64);
        // Rank 0 receives 5 rows from rank 2 and gets back the outputs of its 3 rows sent to 1.
        assert_eq!(
            ex.remote_bytes(hidden),
            vec![
                5 * (row + ids) + 3 * row,
                3 * (row + ids) + 4 * row,
                4 * (row + ids) + 5 * row,
            ]
        );
    }
}
