//! NIXL's C API (`libnixl_capi.so`, shipped in the `nixl-cu12` / `nixl-cu13` wheels), loaded at
//! run time like the CUDA driver: a build needs no NIXL, and a host without it serves normally.
//!
//! Only what a prefill engine needs: one agent with the UCX backend, host memory registered
//! for the decode side to READ, the agent's metadata blob for the side channel, and the
//! notifications the decode side sends when it is done with a request's blocks.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::{Path, PathBuf};

use libloading::Library;

/// Why NIXL cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum NixlError {
    #[error("NIXL is not available: {0}")]
    Missing(String),
    #[error("NIXL {call} failed with status {status}")]
    Call { call: &'static str, status: c_int },
    #[error("NIXL: {0}")]
    Invalid(String),
}

type Handle = *mut c_void;
type Status = c_int;

/// The C API's entry points this engine calls.
struct Api {
    create_configured_agent:
        unsafe extern "C" fn(*const c_char, *const AgentConfig, *mut Handle) -> Status,
    destroy_agent: unsafe extern "C" fn(Handle) -> Status,
    create_params: unsafe extern "C" fn(*mut Handle) -> Status,
    destroy_params: unsafe extern "C" fn(Handle) -> Status,
    create_backend: unsafe extern "C" fn(Handle, *const c_char, Handle, *mut Handle) -> Status,
    destroy_backend: unsafe extern "C" fn(Handle) -> Status,
    create_reg_dlist: unsafe extern "C" fn(c_int, *mut Handle, bool) -> Status,
    destroy_reg_dlist: unsafe extern "C" fn(Handle) -> Status,
    reg_dlist_add_desc:
        unsafe extern "C" fn(Handle, usize, usize, u64, *const c_void, usize) -> Status,
    register_mem: unsafe extern "C" fn(Handle, Handle, Handle) -> Status,
    deregister_mem: unsafe extern "C" fn(Handle, Handle, Handle) -> Status,
    get_local_md: unsafe extern "C" fn(Handle, *mut *mut c_void, *mut usize) -> Status,
    create_notif_map: unsafe extern "C" fn(*mut Handle) -> Status,
    destroy_notif_map: unsafe extern "C" fn(Handle) -> Status,
    get_notifs: unsafe extern "C" fn(Handle, Handle, Handle) -> Status,
    notif_map_size: unsafe extern "C" fn(Handle, *mut usize) -> Status,
    notif_map_get_agent_at: unsafe extern "C" fn(Handle, usize, *mut *const c_char) -> Status,
    notif_map_get_notifs_size: unsafe extern "C" fn(Handle, *const c_char, *mut usize) -> Status,
    notif_map_get_notif: unsafe extern "C" fn(
        Handle,
        *const c_char,
        usize,
        *mut *const c_void,
        *mut usize,
    ) -> Status,
    notif_map_clear: unsafe extern "C" fn(Handle) -> Status,
    load_remote_md: unsafe extern "C" fn(Handle, *const c_void, usize, *mut *mut c_char) -> Status,
    invalidate_remote_md: unsafe extern "C" fn(Handle, *const c_char) -> Status,
    create_xfer_dlist: unsafe extern "C" fn(c_int, *mut Handle, bool) -> Status,
    destroy_xfer_dlist: unsafe extern "C" fn(Handle) -> Status,
    xfer_dlist_add_desc: unsafe extern "C" fn(Handle, usize, usize, u64) -> Status,
    create_opt_args: unsafe extern "C" fn(*mut Handle) -> Status,
    destroy_opt_args: unsafe extern "C" fn(Handle) -> Status,
    opt_args_set_notif_msg: unsafe extern "C" fn(Handle, *const c_void, usize) -> Status,
    opt_args_set_has_notif: unsafe extern "C" fn(Handle, bool) -> Status,
    create_xfer_req: unsafe extern "C" fn(
        Handle,
        c_int,
        Handle,
        Handle,
        *const c_char,
        *mut Handle,
        Handle,
    ) -> Status,
    post_xfer_req: unsafe extern "C" fn(Handle, Handle, Handle) -> Status,
    get_xfer_status: unsafe extern "C" fn(Handle, Handle) -> Status,
    release_xfer_req: unsafe extern "C" fn(Handle, Handle) -> Status,
    destroy_xfer_req: unsafe extern "C" fn(Handle) -> Status,
}

/// `nixl_capi_agent_config_t`. NIXL releases differ in the width of `listen_port` (an `int`,
/// later a `uint16_t`), which moves `thread_sync` and `num_workers`; every field this engine sets
/// sits where both layouts put it, and the others are zero in both (no listener, the default
/// thread sync, the default workers).
#[repr(C)]
#[derive(Default)]
struct AgentConfig {
    enable_prog_thread: bool,
    enable_listen_thread: bool,
    /// `listen_port`, `thread_sync` and `num_workers` in either layout: zero.
    _zero: [u8; 14],
    pthr_delay_us: u64,
    lthr_delay_us: u64,
    capture_telemetry: bool,
}

/// How long NIXL's progress thread sleeps between polls. Its default (0) spins a whole core
/// for as long as the process lives, measured on an idle server; the READs a decode side
/// makes of host memory are one-sided, and notifications wait at most this long.
const PROGRESS_DELAY_US: u64 = 1000;

/// `NIXL_CAPI_MEM_DRAM`.
const MEM_DRAM: c_int = 0;

fn check(call: &'static str, status: Status) -> Result<(), NixlError> {
    match status {
        0 => Ok(()),
        status => Err(NixlError::Call { call, status }),
    }
}

/// Set once `libnixl_capi` is loaded into this process.
static LOADED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether this process loaded NIXL. The wheels' bundled libraries (libnl, through UCX's
/// InfiniBand transport) crash in their exit-time destructors (NIXL 1.5.1), so a process that
/// loaded it ends with `_exit` once its own work is done (see `rackfill serve`).
pub fn loaded() -> bool {
    LOADED.load(std::sync::atomic::Ordering::Acquire)
}

impl Api {
    fn load(path: &Path) -> Result<Self, NixlError> {
        // SAFETY: loading a shared library runs its initialisers; libnixl_capi's are NIXL's own.
        let lib = unsafe { Library::new(path) }
            .map_err(|e| NixlError::Missing(format!("cannot load {}: {e}", path.display())))?;
        // Never unloaded: NIXL's and UCX's threads run its code until the process ends.
        let lib: &'static Library = Box::leak(Box::new(lib));
        LOADED.store(true, std::sync::atomic::Ordering::Release);
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the signature is the one of `wrapper.h` for this symbol.
                *unsafe { lib.get(concat!($name, "\0").as_bytes()) }.map_err(|e| {
                    NixlError::Missing(format!("{} lacks {}: {e}", path.display(), $name))
                })?
            };
        }
        Ok(Self {
            create_configured_agent: sym!("nixl_capi_create_configured_agent"),
            destroy_agent: sym!("nixl_capi_destroy_agent"),
            create_params: sym!("nixl_capi_create_params"),
            destroy_params: sym!("nixl_capi_destroy_params"),
            create_backend: sym!("nixl_capi_create_backend"),
            destroy_backend: sym!("nixl_capi_destroy_backend"),
            create_reg_dlist: sym!("nixl_capi_create_reg_dlist"),
            destroy_reg_dlist: sym!("nixl_capi_destroy_reg_dlist"),
            reg_dlist_add_desc: sym!("nixl_capi_reg_dlist_add_desc"),
            register_mem: sym!("nixl_capi_register_mem"),
            deregister_mem: sym!("nixl_capi_deregister_mem"),
            get_local_md: sym!("nixl_capi_get_local_md"),
            create_notif_map: sym!("nixl_capi_create_notif_map"),
            destroy_notif_map: sym!("nixl_capi_destroy_notif_map"),
            get_notifs: sym!("nixl_capi_get_notifs"),
            notif_map_size: sym!("nixl_capi_notif_map_size"),
            notif_map_get_agent_at: sym!("nixl_capi_notif_map_get_agent_at"),
            notif_map_get_notifs_size: sym!("nixl_capi_notif_map_get_notifs_size"),
            notif_map_get_notif: sym!("nixl_capi_notif_map_get_notif"),
            notif_map_clear: sym!("nixl_capi_notif_map_clear"),
            load_remote_md: sym!("nixl_capi_load_remote_md"),
            invalidate_remote_md: sym!("nixl_capi_invalidate_remote_md"),
            create_xfer_dlist: sym!("nixl_capi_create_xfer_dlist"),
            destroy_xfer_dlist: sym!("nixl_capi_destroy_xfer_dlist"),
            xfer_dlist_add_desc: sym!("nixl_capi_xfer_dlist_add_desc"),
            create_opt_args: sym!("nixl_capi_create_opt_args"),
            destroy_opt_args: sym!("nixl_capi_destroy_opt_args"),
            opt_args_set_notif_msg: sym!("nixl_capi_opt_args_set_notif_msg"),
            opt_args_set_has_notif: sym!("nixl_capi_opt_args_set_has_notif"),
            create_xfer_req: sym!("nixl_capi_create_xfer_req"),
            post_xfer_req: sym!("nixl_capi_post_xfer_req"),
            get_xfer_status: sym!("nixl_capi_get_xfer_status"),
            release_xfer_req: sym!("nixl_capi_release_xfer_req"),
            destroy_xfer_req: sym!("nixl_capi_destroy_xfer_req"),
        })
    }
}

/// Where `libnixl_capi.so` is: `$RACKFILL_NIXL_LIB` (the file), else the `nixl-cu13` or
/// `nixl-cu12` wheel of `python3`'s site-packages.
pub fn find_library() -> Result<PathBuf, NixlError> {
    if let Some(path) = std::env::var_os("RACKFILL_NIXL_LIB") {
        return Ok(PathBuf::from(path));
    }
    let out = std::process::Command::new("python3")
        .args([
            "-c",
            "import site, sys; print('\\n'.join(site.getsitepackages()))",
        ])
        .output()
        .map_err(|e| {
            NixlError::Missing(format!("cannot run python3 to find the nixl wheel: {e}"))
        })?;
    let dirs = String::from_utf8_lossy(&out.stdout).to_string();
    for dir in dirs.lines() {
        for wheel in [".nixl_cu13.mesonpy.libs", ".nixl_cu12.mesonpy.libs"] {
            let path = Path::new(dir).join(wheel).join("libnixl_capi.so");
            if path.is_file() {
                return Ok(path);
            }
        }
    }
    Err(NixlError::Missing(
        "no libnixl_capi.so: `pip install nixl-cu12` (or nixl-cu13), or set RACKFILL_NIXL_LIB"
            .into(),
    ))
}

/// One NIXL agent with the UCX backend.
pub struct Agent {
    api: Api,
    agent: Handle,
    backend: Handle,
    notifs: Handle,
    /// Registered memory descriptor lists, deregistered when the agent is dropped.
    registered: std::sync::Mutex<Vec<Handle>>,
}

// SAFETY: NIXL agents are thread-safe (the C++ agent guards its state); the handles are owned.
unsafe impl Send for Agent {}
unsafe impl Sync for Agent {}

impl Agent {
    /// An agent named `name` (what the decode side knows it by) over UCX, from the library at
    /// `path`.
    pub fn new(path: &Path, name: &str) -> Result<Self, NixlError> {
        let api = Api::load(path)?;
        let cname =
            CString::new(name).map_err(|_| NixlError::Invalid("a NUL in the name".into()))?;
        let mut agent = std::ptr::null_mut();
        // SAFETY: valid C string and out pointer.
        let config = AgentConfig {
            enable_prog_thread: true,
            pthr_delay_us: PROGRESS_DELAY_US,
            ..AgentConfig::default()
        };
        check("create_configured_agent", unsafe {
            (api.create_configured_agent)(cname.as_ptr(), &config, &mut agent)
        })?;
        let mut params = std::ptr::null_mut();
        let mut backend = std::ptr::null_mut();
        let mut notifs = std::ptr::null_mut();
        // SAFETY: handles from the calls above, out pointers valid.
        let made = unsafe {
            check("create_params", (api.create_params)(&mut params))
                .and_then(|()| {
                    let ucx = c"UCX";
                    let status = (api.create_backend)(agent, ucx.as_ptr(), params, &mut backend);
                    (api.destroy_params)(params);
                    check("create_backend UCX", status)
                })
                .and_then(|()| check("create_notif_map", (api.create_notif_map)(&mut notifs)))
        };
        if let Err(err) = made {
            // SAFETY: the agent was created above.
            unsafe { (api.destroy_agent)(agent) };
            return Err(err);
        }
        Ok(Self {
            api,
            agent,
            backend,
            notifs,
            registered: std::sync::Mutex::new(Vec::new()),
        })
    }

    /// Registers the host bytes `[addr, addr + len)` for remote READs, until the agent is
    /// dropped.
    ///
    /// # Safety
    /// The memory must stay allocated while the agent lives.
    pub unsafe fn register_host(&self, addr: usize, len: usize) -> Result<(), NixlError> {
        let mut dlist = std::ptr::null_mut();
        check(
            "create_reg_dlist",
            (self.api.create_reg_dlist)(MEM_DRAM, &mut dlist, false),
        )?;
        let added = check(
            "reg_dlist_add_desc",
            (self.api.reg_dlist_add_desc)(dlist, addr, len, 0, std::ptr::null(), 0),
        )
        .and_then(|()| {
            check(
                "register_mem",
                (self.api.register_mem)(self.agent, dlist, std::ptr::null_mut()),
            )
        });
        if let Err(err) = added {
            (self.api.destroy_reg_dlist)(dlist);
            return Err(err);
        }
        if let Ok(mut registered) = self.registered.lock() {
            registered.push(dlist);
        }
        Ok(())
    }

    /// The agent's metadata: what the decode side loads (`add_remote_agent`) to reach it.
    pub fn metadata(&self) -> Result<Vec<u8>, NixlError> {
        let mut data = std::ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: out pointers valid; the blob is malloc'd by NIXL and freed here.
        unsafe {
            check(
                "get_local_md",
                (self.api.get_local_md)(self.agent, &mut data, &mut len),
            )?;
            let bytes = std::slice::from_raw_parts(data as *const u8, len).to_vec();
            libc::free(data);
            Ok(bytes)
        }
    }

    /// The notifications received since the last call: `(sending agent, message)`.
    pub fn take_notifications(&self) -> Result<Vec<(String, Vec<u8>)>, NixlError> {
        let api = &self.api;
        let mut out = Vec::new();
        // SAFETY: the map is ours; strings and buffers it hands out live until it is cleared.
        unsafe {
            check(
                "get_notifs",
                (api.get_notifs)(self.agent, self.notifs, std::ptr::null_mut()),
            )?;
            let mut agents = 0usize;
            check(
                "notif_map_size",
                (api.notif_map_size)(self.notifs, &mut agents),
            )?;
            for a in 0..agents {
                let mut name = std::ptr::null();
                check(
                    "notif_map_get_agent_at",
                    (api.notif_map_get_agent_at)(self.notifs, a, &mut name),
                )?;
                let mut count = 0usize;
                check(
                    "notif_map_get_notifs_size",
                    (api.notif_map_get_notifs_size)(self.notifs, name, &mut count),
                )?;
                let agent = CStr::from_ptr(name).to_string_lossy().into_owned();
                for i in 0..count {
                    let (mut data, mut len) = (std::ptr::null(), 0usize);
                    check(
                        "notif_map_get_notif",
                        (api.notif_map_get_notif)(self.notifs, name, i, &mut data, &mut len),
                    )?;
                    let bytes = std::slice::from_raw_parts(data as *const u8, len).to_vec();
                    out.push((agent.clone(), bytes));
                }
            }
            check("notif_map_clear", (api.notif_map_clear)(self.notifs))?;
        }
        Ok(out)
    }
}

/// `NIXL_CAPI_XFER_OP_READ`.
const OP_READ: c_int = 0;

/// `NIXL_CAPI_IN_PROG`: a transfer still running.
const IN_PROGRESS: Status = 1;

impl Agent {
    /// Loads a remote agent's metadata (what its side channel hands out); its name, which
    /// transfers and notifications address.
    pub fn add_remote(&self, metadata: &[u8]) -> Result<String, NixlError> {
        let mut name = std::ptr::null_mut();
        // SAFETY: valid buffer and out pointer; NIXL `strdup`s the name, freed here.
        unsafe {
            check(
                "load_remote_md",
                (self.api.load_remote_md)(
                    self.agent,
                    metadata.as_ptr().cast(),
                    metadata.len(),
                    &mut name,
                ),
            )?;
            let owned = CStr::from_ptr(name).to_string_lossy().into_owned();
            libc::free(name.cast());
            Ok(owned)
        }
    }

    /// Forgets a remote agent loaded by [`Agent::add_remote`].
    pub fn remove_remote(&self, name: &str) {
        if let Ok(name) = CString::new(name) {
            // SAFETY: valid C string.
            unsafe { (self.api.invalidate_remote_md)(self.agent, name.as_ptr()) };
        }
    }

    /// READs `remote` (`(address, bytes)` of agent `remote_agent`'s registered host memory)
    /// into `local` (this agent's registered host memory, the same lengths in order), then has
    /// NIXL send `notification` to the remote agent; returns once the data has landed.
    pub fn read(
        &self,
        local: &[(usize, usize)],
        remote: &[(usize, usize)],
        remote_agent: &str,
        notification: &[u8],
        timeout: std::time::Duration,
    ) -> Result<(), NixlError> {
        let api = &self.api;
        let remote_name = CString::new(remote_agent)
            .map_err(|_| NixlError::Invalid("a NUL in the agent name".into()))?;
        let descs = |list: &[(usize, usize)]| -> Result<Handle, NixlError> {
            let mut dlist = std::ptr::null_mut();
            // SAFETY: out pointer valid; the third argument (`sorted`, NIXL 1.5) is false.
            unsafe {
                check(
                    "create_xfer_dlist",
                    (api.create_xfer_dlist)(MEM_DRAM, &mut dlist, false),
                )?;
                for &(addr, len) in list {
                    if let Err(err) = check(
                        "xfer_dlist_add_desc",
                        (api.xfer_dlist_add_desc)(dlist, addr, len, 0),
                    ) {
                        (api.destroy_xfer_dlist)(dlist);
                        return Err(err);
                    }
                }
            }
            Ok(dlist)
        };
        let local = descs(local)?;
        let remote = match descs(remote) {
            Ok(remote) => remote,
            Err(err) => {
                // SAFETY: made above.
                unsafe { (api.destroy_xfer_dlist)(local) };
                return Err(err);
            }
        };
        let mut args = std::ptr::null_mut();
        let mut req = std::ptr::null_mut();
        // SAFETY: every handle is made here and destroyed once below; buffers outlive the calls.
        let result = unsafe {
            check("create_opt_args", (api.create_opt_args)(&mut args))
                .and_then(|()| {
                    check(
                        "opt_args_set_notif_msg",
                        (api.opt_args_set_notif_msg)(
                            args,
                            notification.as_ptr().cast(),
                            notification.len(),
                        ),
                    )
                })
                .and_then(|()| {
                    check(
                        "opt_args_set_has_notif",
                        (api.opt_args_set_has_notif)(args, true),
                    )
                })
                .and_then(|()| {
                    check(
                        "create_xfer_req",
                        (api.create_xfer_req)(
                            self.agent,
                            OP_READ,
                            local,
                            remote,
                            remote_name.as_ptr(),
                            &mut req,
                            args,
                        ),
                    )
                })
                .and_then(|()| {
                    let started = std::time::Instant::now();
                    let mut status = (api.post_xfer_req)(self.agent, req, args);
                    while status == IN_PROGRESS {
                        if started.elapsed() > timeout {
                            return Err(NixlError::Invalid(format!(
                                "the READ did not finish within {timeout:?}"
                            )));
                        }
                        // Polled, not spun: the transfer progresses in NIXL's threads.
                        std::thread::sleep(std::time::Duration::from_micros(20));
                        status = (api.get_xfer_status)(self.agent, req);
                    }
                    check("transfer", status)
                })
        };
        // SAFETY: as above; a request still running is released by NIXL (it aborts it).
        unsafe {
            if !req.is_null() {
                (api.release_xfer_req)(self.agent, req);
                (api.destroy_xfer_req)(req);
            }
            if !args.is_null() {
                (api.destroy_opt_args)(args);
            }
            (api.destroy_xfer_dlist)(local);
            (api.destroy_xfer_dlist)(remote);
        }
        result
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let registered = self
            .registered
            .get_mut()
            .map(std::mem::take)
            .unwrap_or_default();
        // SAFETY: created in `new` and `register_host`, destroyed once.
        unsafe {
            for dlist in registered {
                (self.api.deregister_mem)(self.agent, dlist, std::ptr::null_mut());
                (self.api.destroy_reg_dlist)(dlist);
            }
            (self.api.destroy_notif_map)(self.notifs);
            (self.api.destroy_backend)(self.backend);
            (self.api.destroy_agent)(self.agent);
        }
    }
}
