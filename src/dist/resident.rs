//! Giving memory back while keeping the buffer: ZeRO-3 holds parameters and
//! gradients in full-size arenas of which only the pieces in use are resident.

use std::ops::Range;

/// Makes `buf[range]` read as zeros and hands the whole memory pages inside it back
/// to the operating system (`madvise(MADV_DONTNEED)`); the kernel maps fresh zero
/// pages on the next write, so the buffer keeps its length and address. The parts
/// of `range` on pages shared with the rest of `buf` are zeroed by hand.
pub fn release(buf: &mut [f32], range: Range<usize>) {
    let part = &mut buf[range];
    let (start, end) = whole_pages(part.as_ptr() as usize, part.len() * 4, page_size());
    if start >= end || !madvise_dontneed(start, end - start) {
        part.fill(0.0);
        return;
    }
    let base = part.as_ptr() as usize;
    let (head, rest) = part.split_at_mut((start - base) / 4);
    head.fill(0.0);
    rest[(end - start) / 4..].fill(0.0);
}

/// The page-aligned addresses `start..end` of the whole pages inside `len` bytes at
/// `addr` (`start >= end`: none).
fn whole_pages(addr: usize, len: usize, page: usize) -> (usize, usize) {
    (addr.next_multiple_of(page), (addr + len) / page * page)
}

fn page_size() -> usize {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: sysconf only reads a system setting.
        let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        if n > 0 {
            return n as usize;
        }
    }
    4096
}

/// `madvise(addr, len, MADV_DONTNEED)`; false where it failed or is not available.
fn madvise_dontneed(addr: usize, len: usize) -> bool {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: `addr..addr + len` is made of whole pages inside a `&mut [f32]` the
        // caller holds, from Rust's global allocator (malloc), i.e. private anonymous
        // memory: after MADV_DONTNEED those pages read as zeros, which is a valid
        // f32 value and what the caller asked for; no other reference to them exists.
        unsafe { libc::madvise(addr as *mut libc::c_void, len, libc::MADV_DONTNEED) == 0 }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (addr, len);
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn released_ranges_read_zero_and_the_rest_is_kept() {
        let n = 3 << 20; // 12 MiB
        let mut buf: Vec<f32> = (0..n).map(|i| i as f32 + 1.0).collect();
        let range = 1000..n - 777;
        release(&mut buf, range.clone());
        for (i, &x) in buf.iter().enumerate() {
            let want = if range.contains(&i) {
                0.0
            } else {
                i as f32 + 1.0
            };
            assert_eq!(x, want, "at {i}");
        }
        // A range inside one page: zeroed by hand.
        release(&mut buf, 5..9);
        assert_eq!(&buf[4..10], &[5.0, 0.0, 0.0, 0.0, 0.0, 10.0]);
        // Writable again afterwards.
        buf[range.start + 5] = 2.0;
        assert_eq!(buf[range.start + 5], 2.0);
    }

    /// Resident pages among the whole pages of `buf` (`mincore`).
    #[cfg(target_os = "linux")]
    fn resident_pages(buf: &[f32]) -> usize {
        let (start, end) = whole_pages(buf.as_ptr() as usize, buf.len() * 4, page_size());
        let mut vec = vec![0u8; (end - start) / page_size()];
        // SAFETY: `start..end` are whole pages of `buf`, mapped; `vec` has one byte
        // per page, as mincore writes.
        let rc =
            unsafe { libc::mincore(start as *mut libc::c_void, end - start, vec.as_mut_ptr()) };
        assert_eq!(rc, 0, "mincore");
        vec.iter().filter(|&&b| b & 1 == 1).count()
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn released_pages_leave_the_resident_set() {
        let n = 16 << 20; // 64 MiB of f32
        let mut buf = vec![1.0f32; n];
        let pages = resident_pages(&buf);
        assert!(pages * page_size() >= (60 << 20), "{pages} pages resident");
        release(&mut buf, 0..n);
        assert_eq!(resident_pages(&buf), 0, "every whole page released");
        // (Reading them maps the kernel's shared zero page: no memory.)
        assert!(buf.iter().all(|&x| x == 0.0));
    }

    #[test]
    fn whole_pages_are_inside() {
        assert_eq!(whole_pages(4096, 8192, 4096), (4096, 12288));
        assert_eq!(whole_pages(4100, 8192, 4096), (8192, 12288));
        let (s, e) = whole_pages(4100, 100, 4096);
        assert!(s >= e);
    }
}
