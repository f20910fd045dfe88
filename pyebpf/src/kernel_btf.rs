//! Struct member offsets from the kernel's BTF (`/sys/kernel/btf/vmlinux`), so the eBPF programs
//! can read kernel structures whose layout varies between kernel builds.
//!
//! aya parses BTF too but keeps struct members private, and the one crate exposing them is
//! LGPL-licensed; the part needed here (find a struct, walk its members) is small and fixed by the
//! kernel's BTF specification (Documentation/bpf/btf.rst).

use std::path::Path;

/// Where the running kernel exposes its own BTF.
pub const VMLINUX_BTF: &str = "/sys/kernel/btf/vmlinux";

const MAGIC: u16 = 0xeb9f;
const HEADER_LEN: usize = 24;
const KIND_STRUCT: u32 = 4;
const KIND_UNION: u32 = 5;

#[derive(Debug, thiserror::Error)]
pub enum BtfError {
    #[error("this kernel has no BTF ({VMLINUX_BTF} is missing): pyebpf needs a kernel built with CONFIG_DEBUG_INFO_BTF=y")]
    Missing,
    #[error("cannot read {VMLINUX_BTF}: {0}")]
    Read(std::io::Error),
    #[error("{VMLINUX_BTF} is not valid BTF: {0}")]
    Malformed(&'static str),
    #[error("the kernel's BTF has no struct {0}")]
    NoStruct(String),
    #[error("the kernel's BTF has no member {member} in struct {structure}")]
    NoMember { structure: String, member: String },
    #[error("{structure}.{member} is a bitfield, not a byte-addressable member")]
    Bitfield { structure: String, member: String },
}

/// One type's header: `name_off`, `info` (kind, kind_flag, vlen) and `size`/`type`.
#[derive(Clone, Copy)]
struct TypeHeader {
    name_off: u32,
    info: u32,
    /// Where the type's trailing data (for a struct: its members) starts in the type section.
    data: usize,
}

impl TypeHeader {
    fn kind(&self) -> u32 {
        (self.info >> 24) & 0x1f
    }

    fn vlen(&self) -> usize {
        (self.info & 0xffff) as usize
    }

    /// With kind_flag set, a struct member's offset packs the bitfield size above 24 bits of bit offset.
    fn kind_flag(&self) -> bool {
        self.info >> 31 == 1
    }
}

/// A parsed BTF blob: its type headers by id (id 0 is `void`) and its string section.
pub struct Btf {
    types: Vec<u8>,
    strings: Vec<u8>,
    headers: Vec<TypeHeader>,
}

impl Btf {
    /// The running kernel's BTF.
    pub fn from_kernel() -> Result<Btf, BtfError> {
        Btf::from_file(Path::new(VMLINUX_BTF))
    }

    pub fn from_file(path: &Path) -> Result<Btf, BtfError> {
        match std::fs::read(path) {
            Ok(data) => Btf::parse(&data),
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => Err(BtfError::Missing),
            Err(err) => Err(BtfError::Read(err)),
        }
    }

    pub fn parse(data: &[u8]) -> Result<Btf, BtfError> {
        if data.len() < HEADER_LEN || u16::from_le_bytes([data[0], data[1]]) != MAGIC {
            return Err(BtfError::Malformed("no little-endian BTF header"));
        }
        let hdr_len = u32_at(data, 4).ok_or(BtfError::Malformed("short header"))? as usize;
        let section = |offset_at: usize| -> Result<&[u8], BtfError> {
            let off = u32_at(data, offset_at).ok_or(BtfError::Malformed("short header"))? as usize;
            let len = u32_at(data, offset_at + 4).ok_or(BtfError::Malformed("short header"))? as usize;
            let start = hdr_len.checked_add(off).ok_or(BtfError::Malformed("section out of range"))?;
            data.get(start..start.saturating_add(len)).ok_or(BtfError::Malformed("section out of range"))
        };
        let types = section(8)?.to_vec();
        let strings = section(16)?.to_vec();
        let headers = type_headers(&types)?;
        Ok(Btf { types, strings, headers })
    }

    /// Byte offset of `member` in `struct structure`, looking through anonymous struct and union
    /// members (as a randomized or grouped layout has them).
    pub fn member_offset(&self, structure: &str, member: &str) -> Result<u32, BtfError> {
        let named = |kind| self.headers.iter().position(|t| t.kind() == kind && self.name(t.name_off) == Some(structure));
        let id = named(KIND_STRUCT).ok_or_else(|| BtfError::NoStruct(structure.to_string()))?;
        let bits = self.find_member_bits(id, member, 0).ok_or_else(|| BtfError::NoMember { structure: structure.to_string(), member: member.to_string() })?;
        if bits % 8 != 0 {
            return Err(BtfError::Bitfield { structure: structure.to_string(), member: member.to_string() });
        }
        Ok(bits / 8)
    }

    /// Bit offset of `member` within type `id` (a struct or union), `depth` anonymous levels down.
    fn find_member_bits(&self, id: usize, member: &str, depth: u32) -> Option<u32> {
        let header = *self.headers.get(id)?;
        if !matches!(header.kind(), KIND_STRUCT | KIND_UNION) || depth > 8 {
            return None;
        }
        (0..header.vlen()).find_map(|i| {
            let at = header.data + i * 12;
            let (name_off, type_id, offset) = (u32_at(&self.types, at)?, u32_at(&self.types, at + 4)?, u32_at(&self.types, at + 8)?);
            let bits = if header.kind_flag() { offset & 0x00ff_ffff } else { offset };
            if name_off == 0 {
                let inner = self.skip_modifiers(type_id as usize)?;
                return self.find_member_bits(inner, member, depth + 1).map(|b| b + bits);
            }
            (self.name(name_off) == Some(member)).then_some(bits)
        })
    }

    /// Follows `const`/`volatile`/`typedef` and the like to the type they qualify.
    fn skip_modifiers(&self, mut id: usize) -> Option<usize> {
        for _ in 0..16 {
            let header = self.headers.get(id)?;
            // typedef, volatile, const, restrict, type_tag: `size` holds the qualified type's id.
            if !matches!(header.kind(), 8..=11 | 18) {
                return Some(id);
            }
            id = u32_at(&self.types, header.data - 4)? as usize;
        }
        None
    }

    fn name(&self, offset: u32) -> Option<&str> {
        let tail = self.strings.get(offset as usize..)?;
        let end = tail.iter().position(|&b| b == 0)?;
        std::str::from_utf8(&tail[..end]).ok()
    }
}

/// Walks the type section once, recording where each type starts; index = type id.
fn type_headers(types: &[u8]) -> Result<Vec<TypeHeader>, BtfError> {
    let mut headers = vec![TypeHeader { name_off: 0, info: 0, data: 0 }];
    let mut at = 0;
    while at < types.len() {
        let (name_off, info) = (u32_at(types, at), u32_at(types, at + 4));
        let (Some(name_off), Some(info), Some(_)) = (name_off, info, u32_at(types, at + 8)) else {
            return Err(BtfError::Malformed("truncated type"));
        };
        let header = TypeHeader { name_off, info, data: at + 12 };
        at = header.data + trailing_len(&header).ok_or(BtfError::Malformed("unknown type kind"))?;
        headers.push(header);
    }
    if at > types.len() {
        return Err(BtfError::Malformed("truncated type"));
    }
    Ok(headers)
}

/// Bytes that follow a type's 12-byte header, by kind.
fn trailing_len(header: &TypeHeader) -> Option<usize> {
    let vlen = header.vlen();
    Some(match header.kind() {
        // int, var, decl_tag: one u32.
        1 | 14 | 17 => 4,
        // array: element type, index type, count.
        3 => 12,
        // struct, union, datasec, enum64: 12 bytes per entry.
        4 | 5 | 15 | 19 => 12 * vlen,
        // enum, func_proto: 8 bytes per entry.
        6 | 13 => 8 * vlen,
        // ptr, fwd, typedef, volatile, const, restrict, func, float, type_tag.
        2 | 7..=12 | 16 | 18 => 0,
        _ => return None,
    })
}

fn u32_at(data: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(data.get(at..at.checked_add(4)?)?.try_into().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Builds a BTF blob from (name, info, size_or_type, trailing u32s) entries.
    fn blob(strings: &[u8], types: &[(u32, u32, u32, Vec<u32>)]) -> Vec<u8> {
        let mut section = Vec::new();
        for (name, info, size, trailing) in types {
            for word in [*name, *info, *size].iter().chain(trailing) {
                section.extend_from_slice(&word.to_le_bytes());
            }
        }
        let mut data = Vec::new();
        data.extend_from_slice(&MAGIC.to_le_bytes());
        data.extend_from_slice(&[1, 0]);
        for word in [HEADER_LEN as u32, 0, section.len() as u32, section.len() as u32, strings.len() as u32] {
            data.extend_from_slice(&word.to_le_bytes());
        }
        data.extend_from_slice(&section);
        data.extend_from_slice(strings);
        data
    }

    const fn info(kind: u32, vlen: u32, kind_flag: bool) -> u32 {
        (kind_flag as u32) << 31 | kind << 24 | vlen
    }

    // Offsets into STRINGS.
    const INT: u32 = 1;
    const TASK: u32 = 5;
    const PID: u32 = 10;
    const TGID: u32 = 14;
    const FLAGS: u32 = 19;
    const STRINGS: &[u8] = b"\0int\0task\0pid\0tgid\0flags\0";

    #[test]
    fn finds_members_directly_through_anonymous_members_and_with_bitfield_encoding() {
        let btf = Btf::parse(&blob(
            STRINGS,
            &[
                // 1: int
                (INT, info(1, 0, false), 4, vec![32]),
                // 2: anonymous struct { int tgid; } (after a const, as qualifiers may sit between)
                (0, info(4, 1, false), 4, vec![TGID, 1, 0]),
                // 3: const of 2
                (0, info(10, 0, false), 2, vec![]),
                // 4: struct task (kind_flag): flags:3 at bit 0, pid at 32, anonymous at 64
                (TASK, info(4, 3, true), 12, vec![FLAGS, 1, 3 << 24, PID, 1, 32, 0, 3, 64]),
            ],
        ))
        .unwrap();
        assert_eq!(btf.member_offset("task", "pid").unwrap(), 4);
        assert_eq!(btf.member_offset("task", "tgid").unwrap(), 8);
        assert_eq!(btf.member_offset("task", "flags").unwrap(), 0);
        assert!(matches!(btf.member_offset("task", "comm"), Err(BtfError::NoMember { .. })));
        assert!(matches!(btf.member_offset("mm", "pid"), Err(BtfError::NoStruct(_))));
    }

    #[test]
    fn rejects_bitfields_not_on_a_byte() {
        let btf = Btf::parse(&blob(STRINGS, &[(INT, info(1, 0, false), 4, vec![32]), (TASK, info(4, 1, true), 4, vec![PID, 1, 3 << 24 | 5])])).unwrap();
        assert!(matches!(btf.member_offset("task", "pid"), Err(BtfError::Bitfield { .. })));
    }

    #[test]
    fn rejects_damaged_blobs_without_panicking() {
        let good = blob(STRINGS, &[(INT, info(1, 0, false), 4, vec![32]), (TASK, info(4, 1, false), 4, vec![PID, 1, 0])]);
        for len in 0..good.len() {
            let _ = Btf::parse(&good[..len]);
        }
        let mut bad_kind = good.clone();
        bad_kind[HEADER_LEN + 7] = 31;
        assert!(matches!(Btf::parse(&bad_kind), Err(BtfError::Malformed(_))));
        assert!(matches!(Btf::from_file(Path::new("/nonexistent/vmlinux")), Err(BtfError::Missing)));
    }

    #[test]
    fn reads_task_struct_from_the_running_kernel() {
        let btf = Btf::from_kernel().expect("this machine's kernel has BTF");
        let pid = btf.member_offset("task_struct", "pid").unwrap();
        let tgid = btf.member_offset("task_struct", "tgid").unwrap();
        // pid_t pid; pid_t tgid; sit side by side in every kernel since 2.6.
        assert_eq!(tgid, pid + 4);
        assert!(tgid > 0 && tgid < 16384, "{tgid}");
    }
}
