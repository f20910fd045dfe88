//! Reading (and, for one validated field, writing) another process's memory.

use std::cell::Cell;
use std::io;

#[derive(Debug, thiserror::Error)]
pub enum MemError {
    #[error("cannot read {len} bytes at {addr:#x}: {source}")]
    Read { addr: u64, len: usize, source: io::Error },
    #[error("short read of {len} bytes at {addr:#x}")]
    Short { addr: u64, len: usize },
    #[error("cannot write at {addr:#x}: {source}")]
    Write { addr: u64, source: io::Error },
}

/// Remote reads (system calls) and bytes read so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemCounters {
    pub reads: u64,
    pub bytes: u64,
}

pub trait ReadMemory {
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), MemError>;
    /// Fills several buffers in one remote read; returns how many leading requests were filled.
    fn read_many(&self, requests: &mut [(u64, &mut [u8])]) -> usize;
    fn counters(&self) -> MemCounters;
}

/// Another process's memory through `process_vm_readv`.
pub struct ProcessMemory {
    pid: u32,
    counters: Cell<MemCounters>,
}

/// The kernel's limit on iovecs per call.
const IOV_MAX: usize = 1024;

impl ProcessMemory {
    pub fn new(pid: u32) -> Self {
        ProcessMemory { pid, counters: Cell::new(MemCounters::default()) }
    }

    fn count(&self, bytes: usize) {
        let mut c = self.counters.get();
        c.reads += 1;
        c.bytes += bytes as u64;
        self.counters.set(c);
    }

    /// Writes one 8-byte value. Only the validated marker field may be written: see
    /// `PyProcess::set_last_profiled_frame`, the only caller.
    pub(super) fn write_u64(&self, addr: u64, value: u64) -> Result<(), MemError> {
        let bytes = value.to_ne_bytes();
        let local = libc::iovec { iov_base: bytes.as_ptr() as *mut libc::c_void, iov_len: 8 };
        let remote = libc::iovec { iov_base: addr as *mut libc::c_void, iov_len: 8 };
        // SAFETY: both iovecs describe 8 valid bytes; the kernel checks the remote range.
        let written = unsafe { libc::process_vm_writev(self.pid as libc::pid_t, &local, 1, &remote, 1, 0) };
        match written {
            8 => Ok(()),
            -1 => Err(MemError::Write { addr, source: io::Error::last_os_error() }),
            _ => Err(MemError::Write { addr, source: io::Error::other("short write") }),
        }
    }
}

impl ReadMemory for ProcessMemory {
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), MemError> {
        let len = buf.len();
        let local = libc::iovec { iov_base: buf.as_mut_ptr() as *mut libc::c_void, iov_len: len };
        let remote = libc::iovec { iov_base: addr as *mut libc::c_void, iov_len: len };
        self.count(len);
        // SAFETY: `local` covers `buf`; the kernel checks the remote range.
        let read = unsafe { libc::process_vm_readv(self.pid as libc::pid_t, &local, 1, &remote, 1, 0) };
        if read < 0 {
            return Err(MemError::Read { addr, len, source: io::Error::last_os_error() });
        }
        if read as usize != len {
            return Err(MemError::Short { addr, len });
        }
        Ok(())
    }

    fn read_many(&self, requests: &mut [(u64, &mut [u8])]) -> usize {
        let mut filled = 0;
        for chunk in requests.chunks_mut(IOV_MAX) {
            let local: Vec<libc::iovec> = chunk
                .iter_mut()
                .map(|(_, buf)| libc::iovec { iov_base: buf.as_mut_ptr() as *mut libc::c_void, iov_len: buf.len() })
                .collect();
            let remote: Vec<libc::iovec> = chunk
                .iter()
                .map(|(addr, buf)| libc::iovec { iov_base: *addr as *mut libc::c_void, iov_len: buf.len() })
                .collect();
            let wanted: usize = chunk.iter().map(|(_, buf)| buf.len()).sum();
            self.count(wanted);
            // SAFETY: each local iovec covers its buffer; the kernel checks the remote ranges.
            let read = unsafe {
                libc::process_vm_readv(self.pid as libc::pid_t, local.as_ptr(), local.len() as u64, remote.as_ptr(), remote.len() as u64, 0)
            };
            let mut left = read.max(0) as usize;
            for (_, buf) in chunk.iter() {
                if left < buf.len() {
                    return filled;
                }
                left -= buf.len();
                filled += 1;
            }
        }
        filled
    }

    fn counters(&self) -> MemCounters {
        self.counters.get()
    }
}

/// Little-endian integer readers over any memory.
pub trait ReadExt: ReadMemory {
    fn read_u64(&self, addr: u64) -> Result<u64, MemError> {
        let mut buf = [0; 8];
        self.read(addr, &mut buf)?;
        Ok(u64::from_le_bytes(buf))
    }

    fn read_u32(&self, addr: u64) -> Result<u32, MemError> {
        let mut buf = [0; 4];
        self.read(addr, &mut buf)?;
        Ok(u32::from_le_bytes(buf))
    }

    fn read_vec(&self, addr: u64, len: usize) -> Result<Vec<u8>, MemError> {
        let mut buf = vec![0; len];
        self.read(addr, &mut buf)?;
        Ok(buf)
    }
}

impl<M: ReadMemory + ?Sized> ReadExt for M {}

/// Little-endian fields of a buffer already read; a field outside the buffer (an offset from a
/// malformed table) reads as 0, which later reads reject as a null pointer.
pub fn field_u64(buf: &[u8], offset: u64) -> u64 {
    field::<8>(buf, offset).map_or(0, u64::from_le_bytes)
}

pub fn field_u32(buf: &[u8], offset: u64) -> u32 {
    field::<4>(buf, offset).map_or(0, u32::from_le_bytes)
}

fn field<const N: usize>(buf: &[u8], offset: u64) -> Option<[u8; N]> {
    let start = usize::try_from(offset).ok()?;
    buf.get(start..start.checked_add(N)?)?.try_into().ok()
}
