//! Devices, opened directly (without the connection manager).

use std::ffi::CStr;
use std::ptr::NonNull;

use rdma_sys as ffi;

use super::{errno_error, last_os_error, Error, Result};

/// The names of the RDMA devices on this machine (`ibv_get_device_list`).
pub fn device_names() -> Result<Vec<String>> {
    with_device_list(|devices| {
        Ok(devices
            .iter()
            .map(|d| {
                // SAFETY: `d` is a device of a live list; the name is a
                // NUL-terminated string owned by the device.
                unsafe { CStr::from_ptr(ffi::ibv_get_device_name(d.as_ptr())) }
                    .to_string_lossy()
                    .into_owned()
            })
            .collect())
    })
}

/// Runs `f` on the device list, freeing it afterwards.
fn with_device_list<T>(f: impl FnOnce(&[NonNull<ffi::ibv_device>]) -> Result<T>) -> Result<T> {
    let mut n = 0;
    // SAFETY: `n` is a valid out-pointer; the list is freed below.
    let list = unsafe { ffi::ibv_get_device_list(&mut n) };
    if list.is_null() {
        return Err(Error::GetDeviceList(last_os_error()));
    }
    let count = usize::try_from(n).unwrap_or(0);
    // SAFETY: on success the list holds `n` device pointers (then NULL).
    let devices: Vec<NonNull<ffi::ibv_device>> = (0..count)
        .filter_map(|i| NonNull::new(unsafe { *list.add(i) }))
        .collect();
    let result = f(&devices);
    // SAFETY: `list` came from ibv_get_device_list and is freed once;
    // contexts opened from its devices stay valid after this.
    unsafe { ffi::ibv_free_device_list(list) };
    result
}

/// An open device (`ibv_open_device`), for queries.
pub struct Context {
    raw: NonNull<ffi::ibv_context>,
}

/// What [`Context::port`] reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortInfo {
    /// `ibv_port_state` (4 = `IBV_PORT_ACTIVE`).
    pub state: u32,
    /// As `ibv_port_state_str` names it, e.g. `PORT_ACTIVE`.
    pub state_name: String,
    /// The active MTU in bytes.
    pub active_mtu: u32,
}

impl PortInfo {
    /// True when the port can carry traffic.
    pub fn is_active(&self) -> bool {
        self.state == ffi::ibv_port_state::IBV_PORT_ACTIVE
    }
}

impl Context {
    /// Opens the device called `name`.
    pub fn open(name: &str) -> Result<Self> {
        with_device_list(|devices| {
            for d in devices {
                // SAFETY: as in `device_names`.
                let dname = unsafe { CStr::from_ptr(ffi::ibv_get_device_name(d.as_ptr())) };
                if dname.to_bytes() == name.as_bytes() {
                    // SAFETY: `d` is a device of the live list.
                    let raw = unsafe { ffi::ibv_open_device(d.as_ptr()) };
                    return NonNull::new(raw).map(|raw| Self { raw }).ok_or_else(|| {
                        Error::OpenDevice {
                            name: name.to_string(),
                            source: last_os_error(),
                        }
                    });
                }
            }
            Err(Error::DeviceNotFound {
                name: name.to_string(),
                available: device_names().unwrap_or_default(),
            })
        })
    }

    /// Queries port `port` (`ibv_query_port`; ports count from 1).
    pub fn port(&self, port: u8) -> Result<PortInfo> {
        let mut attr = std::mem::MaybeUninit::<ffi::ibv_port_attr>::zeroed();
        // SAFETY: the context is live; `attr` is writable and its size is
        // what the provider is told.
        let ret = unsafe { ffi::___ibv_query_port(self.raw.as_ptr(), port, attr.as_mut_ptr()) };
        if ret != 0 {
            return Err(Error::QueryPort(errno_error(ret)));
        }
        // SAFETY: filled by a successful query (and zeroed is valid too).
        let attr = unsafe { attr.assume_init() };
        // SAFETY: ibv_port_state_str returns a static string for any value.
        let state_name = unsafe { CStr::from_ptr(ffi::ibv_port_state_str(attr.state)) };
        Ok(PortInfo {
            state: attr.state,
            state_name: state_name.to_string_lossy().into_owned(),
            active_mtu: 128u32 << attr.active_mtu.min(5),
        })
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: the context is live and closed once; nothing else was
        // made from it.
        unsafe { ffi::ibv_close_device(self.raw.as_ptr()) };
    }
}
