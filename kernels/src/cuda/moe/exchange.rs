//! How a layer's rows reach their destination ranks and the experts' outputs come back: device
//! copies between ranks of this process, and to ranks of other processes either straight into
//! their windows of peer memory ([`super::peers`]) or through host buffers and the group's
//! transport ([`HostExchange`]).

use super::super::exec::DeviceBuffer;
use super::super::CudaError;
use super::layer::LayerInFlight;
use super::peers::Signal;
use super::plane::MoeLane;
use super::remote::HostExchange;
use super::routes::Routes;
use super::steps::{Received, Sent};
use crate::KernelError;

impl MoeLane {
    /// Every local source's segments copied straight into each destination's receive buffer
    /// in peer memory (this process's or another's), then each local source's dispatch signal
    /// to every rank and each local destination's wait for every source's: bytes cross
    /// processes device to device. Returns the local destinations' rows, in their windows.
    pub(super) fn dispatch_to_peers(
        &self,
        routes: &Routes,
        sent: &[Option<Sent>],
        epoch: u32,
    ) -> Result<Vec<Option<Received>>, CudaError> {
        let shared = &self.shared;
        let exec = shared.exec.as_ref();
        let peers = self.peers.as_ref().ok_or(KernelError::ZeroDimension {
            what: "peer windows",
        })?;
        let row = shared.hidden * 2;
        for (i, src) in shared.local.clone().enumerate() {
            let Some(from) = sent[i].as_ref() else {
                continue;
            };
            for dst in 0..shared.layout.ranks() {
                let n = routes.sent(src, dst);
                if n == 0 {
                    continue;
                }
                let [rows, experts, instances] = peers.receive(dst)?;
                let (at, to) = (routes.send_offset(src, dst), routes.recv_offset(src, dst));
                exec.copy_on(
                    self.main,
                    (&from.rows, at * row),
                    (&rows, to * row),
                    n * row,
                )?;
                exec.copy_on(
                    self.main,
                    (&from.experts, at * 4),
                    (&experts, to * 4),
                    n * 4,
                )?;
                exec.copy_on(
                    self.main,
                    (&from.instances, at * 4),
                    (&instances, to * 4),
                    n * 4,
                )?;
            }
        }
        for src in shared.local.clone() {
            peers.signal(exec, self.main, (Signal::Dispatch, src), epoch)?;
        }
        let mut received = Vec::with_capacity(shared.local.len());
        for dst in shared.local.clone() {
            peers.wait(exec, self.main, (Signal::Dispatch, dst), epoch)?;
            let len = routes.received(dst);
            received.push(if len > 0 {
                let [rows, experts, instances] = peers.receive(dst)?;
                Some(Received {
                    rows,
                    experts,
                    instances,
                    len,
                })
            } else {
                None
            });
        }
        Ok(received)
    }

    /// Every local destination's rows: segments of local senders copied on the device, those of
    /// other processes' ranks through `remote` (each row's bf16 values, then the expert ids,
    /// then the instance ids).
    pub(super) fn dispatch(
        &self,
        routes: &Routes,
        sent: &[Option<Sent>],
        remote: Option<&dyn HostExchange>,
    ) -> Result<Vec<Option<Received>>, CudaError> {
        let shared = &self.shared;
        let exec = shared.exec.as_ref();
        let ranks = shared.layout.ranks();
        let row = shared.hidden * 2;
        let steps = self.steps();
        let mut received = Vec::with_capacity(shared.local.len());
        for dst in shared.local.clone() {
            let len = routes.received(dst);
            received.push((len > 0).then(|| steps.receive_buffer(len)).transpose()?);
        }
        // Local senders: device copies.
        for (index, dst) in shared.local.clone().enumerate() {
            let Some(recv) = received[index].as_ref() else {
                continue;
            };
            for (i, src) in shared.local.clone().enumerate() {
                let n = routes.sent(src, dst);
                let Some(from) = sent[i].as_ref().filter(|_| n > 0) else {
                    continue;
                };
                let (at, to) = (routes.send_offset(src, dst), routes.recv_offset(src, dst));
                exec.copy_on(
                    self.main,
                    (&from.rows, at * row),
                    (&recv.rows, to * row),
                    n * row,
                )?;
                exec.copy_on(
                    self.main,
                    (&from.experts, at * 4),
                    (&recv.experts, to * 4),
                    n * 4,
                )?;
                exec.copy_on(
                    self.main,
                    (&from.instances, at * 4),
                    (&recv.instances, to * 4),
                    n * 4,
                )?;
            }
        }
        let Some(remote) = remote.filter(|_| !shared.all_local()) else {
            return Ok(received);
        };
        // Other processes' ranks: through host buffers.
        let mut outgoing = Vec::with_capacity(shared.local.len());
        for (i, src) in shared.local.clone().enumerate() {
            let mut messages = vec![Vec::new(); ranks];
            for (dst, message) in messages.iter_mut().enumerate() {
                let n = routes.sent(src, dst);
                let Some(from) = sent[i]
                    .as_ref()
                    .filter(|_| n > 0 && shared.index(dst).is_none())
                else {
                    continue;
                };
                let at = routes.send_offset(src, dst);
                *message = vec![0u8; n * (row + 8)];
                let (rows, ids) = message.split_at_mut(n * row);
                let (experts, instances) = ids.split_at_mut(n * 4);
                exec.read_on(self.main, &from.rows, at * row, rows)?;
                exec.read_on(self.main, &from.experts, at * 4, experts)?;
                exec.read_on(self.main, &from.instances, at * 4, instances)?;
            }
            outgoing.push(messages);
        }
        let incoming = remote.all_to_all(outgoing).map_err(CudaError::Exec)?;
        for (index, dst) in shared.local.clone().enumerate() {
            for (src, message) in incoming[index].iter().enumerate() {
                let n = routes.sent(src, dst);
                if n == 0 || shared.index(src).is_some() {
                    continue;
                }
                if message.len() != n * (row + 8) {
                    return Err(CudaError::Exec(format!(
                        "rank {dst} received {} bytes from rank {src}, expected {}",
                        message.len(),
                        n * (row + 8)
                    )));
                }
                let recv = received[index].as_ref().ok_or(KernelError::ZeroDimension {
                    what: "receive buffer",
                })?;
                let to = routes.recv_offset(src, dst);
                let (rows, ids) = message.split_at(n * row);
                let (experts, instances) = ids.split_at(n * 4);
                exec.write_on(self.main, &recv.rows, to * row, rows)?;
                exec.write_on(self.main, &recv.experts, to * 4, experts)?;
                exec.write_on(self.main, &recv.instances, to * 4, instances)?;
            }
        }
        Ok(received)
    }

    /// Every local source's outputs back in its send layout: device copies from local
    /// destinations, host buffers and `remote` from the others.
    pub(super) fn return_outputs(
        &self,
        flight: &LayerInFlight,
        remote: Option<&dyn HostExchange>,
    ) -> Result<Vec<Option<DeviceBuffer>>, CudaError> {
        let shared = self.shared.clone();
        let exec = shared.exec.clone();
        let (h, ranks) = (shared.hidden, shared.layout.ranks());
        let row = h * 4;
        let routes = &flight.routes;
        let mut returned = Vec::with_capacity(shared.local.len());
        for src in shared.local.clone() {
            let pairs = routes.sent_total(src);
            returned.push(
                (pairs > 0)
                    .then(|| exec.alloc_zeroed_on(self.main, pairs * row))
                    .transpose()?,
            );
        }
        for (i, src) in shared.local.clone().enumerate() {
            for (index, dst) in shared.local.clone().enumerate() {
                let n = routes.sent(src, dst);
                let (Some(to), Some(Some(from))) =
                    (returned[i].as_ref(), flight.computed.get(index))
                else {
                    continue;
                };
                if n == 0 {
                    continue;
                }
                exec.copy_on(
                    self.main,
                    (from, routes.recv_offset(src, dst) * row),
                    (to, routes.send_offset(src, dst) * row),
                    n * row,
                )?;
            }
        }
        if let Some(remote) = remote.filter(|_| !shared.all_local()) {
            let mut outgoing = Vec::with_capacity(shared.local.len());
            for (index, dst) in shared.local.clone().enumerate() {
                let mut messages = vec![Vec::new(); ranks];
                for (src, message) in messages.iter_mut().enumerate() {
                    let n = routes.sent(src, dst);
                    let Some(Some(from)) = flight.computed.get(index) else {
                        continue;
                    };
                    if n == 0 || shared.index(src).is_some() {
                        continue;
                    }
                    *message = vec![0u8; n * row];
                    exec.read_on(self.main, from, routes.recv_offset(src, dst) * row, message)?;
                }
                outgoing.push(messages);
            }
            let incoming = remote.all_to_all(outgoing).map_err(CudaError::Exec)?;
            for (i, src) in shared.local.clone().enumerate() {
                for (dst, message) in incoming[i].iter().enumerate() {
                    let n = routes.sent(src, dst);
                    if n == 0 || shared.index(dst).is_some() {
                        continue;
                    }
                    if message.len() != n * row {
                        return Err(CudaError::Exec(format!(
                            "rank {src} got {} bytes of outputs back from rank {dst}, expected {}",
                            message.len(),
                            n * row
                        )));
                    }
                    let to = returned[i].as_ref().ok_or(KernelError::ZeroDimension {
                        what: "returned outputs",
                    })?;
                    exec.write_on(self.main, to, routes.send_offset(src, dst) * row, message)?;
                }
            }
        }
        Ok(returned)
    }

    /// Every local destination's outputs copied straight into each source's return buffer in
    /// peer memory, its combine signal to every rank, then each local source's wait for every
    /// destination's and the check that no wait gave up. Returns the local sources' outputs,
    /// in their windows.
    pub(super) fn return_to_peers(
        &self,
        flight: &LayerInFlight,
        epoch: u32,
    ) -> Result<Vec<Option<DeviceBuffer>>, CudaError> {
        let shared = &self.shared;
        let exec = shared.exec.as_ref();
        let peers = self.peers.as_ref().ok_or(KernelError::ZeroDimension {
            what: "peer windows",
        })?;
        let row = shared.hidden * 4;
        let routes = &flight.routes;
        for (index, dst) in shared.local.clone().enumerate() {
            let Some(Some(from)) = flight.computed.get(index) else {
                continue;
            };
            for src in 0..shared.layout.ranks() {
                let n = routes.sent(src, dst);
                if n == 0 {
                    continue;
                }
                exec.copy_on(
                    self.main,
                    (from, routes.recv_offset(src, dst) * row),
                    (&peers.returned(src)?, routes.send_offset(src, dst) * row),
                    n * row,
                )?;
            }
        }
        for dst in shared.local.clone() {
            peers.signal(exec, self.main, (Signal::Combine, dst), epoch)?;
        }
        let mut returned = Vec::with_capacity(shared.local.len());
        for src in shared.local.clone() {
            peers.wait(exec, self.main, (Signal::Combine, src), epoch)?;
            returned.push(
                (routes.sent_total(src) > 0)
                    .then(|| peers.returned(src))
                    .transpose()?,
            );
        }
        peers.check(exec, self.main)?;
        Ok(returned)
    }
}
