//! Reading (and, for one validated field, writing) another process's memory.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::io;
use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum MemError {
    #[error("cannot read {len} bytes at {addr:#x}: {cause}")]
    Read { addr: u64, len: usize, cause: io::Error },
    #[error("short read of {len} bytes at {addr:#x}")]
    Short { addr: u64, len: usize },
    #[error("cannot write at {addr:#x}: {cause}")]
    Write { addr: u64, cause: io::Error },
}

impl MemError {
    /// Whether the read failed because the process is gone (or is exiting and has no memory left).
    pub fn process_gone(&self) -> bool {
        matches!(self, MemError::Read { cause, .. } | MemError::Write { cause, .. } if cause.raw_os_error() == Some(libc::ESRCH))
    }

    /// Whether the kernel refused access to the process (not root, no CAP_SYS_PTRACE, Yama).
    pub fn permission_denied(&self) -> bool {
        let errno = match self {
            MemError::Read { cause, .. } | MemError::Write { cause, .. } => cause.raw_os_error(),
            MemError::Short { .. } => None,
        };
        matches!(errno, Some(libc::EPERM | libc::EACCES))
    }
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
    /// Memory held here reads them one by one.
    fn read_many(&self, requests: &mut [(u64, &mut [u8])]) -> usize {
        let mut filled = 0;
        for (addr, buf) in requests.iter_mut() {
            if self.read(*addr, buf).is_err() {
                break;
            }
            filled += 1;
        }
        filled
    }
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
}

/// Writing into another process's memory. Only the validated marker field is ever written: see
/// `PyProcess::set_last_profiled_frame`, the only caller.
pub trait WriteMemory {
    fn write_u64(&self, addr: u64, value: u64) -> Result<(), MemError>;
}

impl WriteMemory for ProcessMemory {
    fn write_u64(&self, addr: u64, value: u64) -> Result<(), MemError> {
        let bytes = value.to_ne_bytes();
        let local = libc::iovec { iov_base: bytes.as_ptr() as *mut libc::c_void, iov_len: 8 };
        let remote = libc::iovec { iov_base: addr as *mut libc::c_void, iov_len: 8 };
        // SAFETY: both iovecs describe 8 valid bytes; the kernel checks the remote range.
        let written = unsafe { libc::process_vm_writev(self.pid as libc::pid_t, &local, 1, &remote, 1, 0) };
        match written {
            8 => Ok(()),
            -1 => Err(MemError::Write { addr, cause: io::Error::last_os_error() }),
            _ => Err(MemError::Write { addr, cause: io::Error::other("short write") }),
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
            return Err(MemError::Read { addr, len, cause: io::Error::last_os_error() });
        }
        if read as usize != len {
            return Err(MemError::Short { addr, len });
        }
        Ok(())
    }

    fn read_many(&self, requests: &mut [(u64, &mut [u8])]) -> usize {
        let mut filled = 0;
        for chunk in requests.chunks_mut(IOV_MAX) {
            let local: Vec<libc::iovec> =
                chunk.iter_mut().map(|(_, buf)| libc::iovec { iov_base: buf.as_mut_ptr() as *mut libc::c_void, iov_len: buf.len() }).collect();
            let remote: Vec<libc::iovec> = chunk.iter().map(|(addr, buf)| libc::iovec { iov_base: *addr as *mut libc::c_void, iov_len: buf.len() }).collect();
            let wanted: usize = chunk.iter().map(|(_, buf)| buf.len()).sum();
            self.count(wanted);
            // SAFETY: each local iovec covers its buffer; the kernel checks the remote ranges.
            let read = unsafe { libc::process_vm_readv(self.pid as libc::pid_t, local.as_ptr(), local.len() as u64, remote.as_ptr(), remote.len() as u64, 0) };
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

/// Little-endian fields of a buffer already read; fields outside the buffer read as 0 (offsets
/// come from the target process, so they are never trusted to be in range).
pub fn field_u64(buf: &[u8], offset: u64) -> u64 {
    field(buf, offset).map_or(0, u64::from_le_bytes)
}

pub fn field_u32(buf: &[u8], offset: u64) -> u32 {
    field(buf, offset).map_or(0, u32::from_le_bytes)
}

fn field<const N: usize>(buf: &[u8], offset: u64) -> Option<[u8; N]> {
    let start = usize::try_from(offset).ok()?;
    buf.get(start..start.checked_add(N)?)?.try_into().ok()
}

/// Memory held in this process as byte ranges, for tests and fuzzing: reads outside the ranges
/// fail as reads of unmapped memory do. Clones share ranges until one is changed, so a fuzzer can
/// copy a large image per case.
#[derive(Clone, Debug, Default)]
pub struct MemoryImage {
    regions: BTreeMap<u64, Arc<Vec<u8>>>,
}

impl MemoryImage {
    /// Adds (or replaces) the range starting at `addr`.
    pub fn insert(&mut self, addr: u64, bytes: Vec<u8>) {
        self.regions.insert(addr, Arc::new(bytes));
    }

    /// Start address and length of every range, in address order.
    pub fn ranges(&self) -> impl Iterator<Item = (u64, usize)> + '_ {
        self.regions.iter().map(|(addr, bytes)| (*addr, bytes.len()))
    }

    /// The bytes of the range starting exactly at `addr`, for mutation.
    pub fn range_mut(&mut self, addr: u64) -> Option<&mut [u8]> {
        self.regions.get_mut(&addr).map(|bytes| Arc::make_mut(bytes).as_mut_slice())
    }

    fn slice(&self, addr: u64, len: usize) -> Option<&[u8]> {
        let (start, bytes) = self.regions.range(..=addr).next_back()?;
        let from = usize::try_from(addr - start).ok()?;
        bytes.get(from..from.checked_add(len)?)
    }
}

impl ReadMemory for MemoryImage {
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), MemError> {
        let bytes = self.slice(addr, buf.len()).ok_or(MemError::Short { addr, len: buf.len() })?;
        buf.copy_from_slice(bytes);
        Ok(())
    }

    fn counters(&self) -> MemCounters {
        MemCounters::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_outside_the_buffer_read_as_zero() {
        let buf = [1u8, 0, 0, 0, 0, 0, 0, 0, 2];
        assert_eq!(field_u64(&buf, 0), 1);
        assert_eq!(field_u64(&buf, 1), 0x0200_0000_0000_0000);
        assert_eq!(field_u64(&buf, 2), 0);
        assert_eq!(field_u32(&buf, u64::MAX), 0);
        assert_eq!(field_u64(&buf, u64::MAX - 3), 0);
    }

    #[test]
    fn image_reads_only_inside_its_ranges() {
        let mut image = MemoryImage::default();
        image.insert(0x1000, vec![1, 2, 3, 4]);
        assert_eq!(image.read_u32(0x1000).unwrap(), 0x0403_0201);
        assert!(image.read_u32(0x1001).is_err());
        assert!(image.read_u32(0xfff).is_err());
        assert!(image.read_vec(u64::MAX, 2).is_err());
        let (mut a, mut b) = ([0u8; 2], [0u8; 2]);
        let mut requests: Vec<(u64, &mut [u8])> = vec![(0x1000, &mut a), (0x1003, &mut b)];
        assert_eq!(image.read_many(&mut requests), 1);
    }
}
