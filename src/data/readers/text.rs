//! Plain text: a `.txt` file read whole as one document, or read in chunks that
//! end where GPT-2's pre-tokenizer ends a token anyway.

use std::io::Read;
use std::path::Path;

use anyhow::{Context, Result};

use super::{not_utf8, Piece};

/// Chunks of a single document aim for this many bytes...
const CHUNK_BYTES: usize = 256 << 10;
/// ...and are cut anywhere (on a character boundary) past this size.
const MAX_CHUNK_BYTES: usize = 16 << 20;

pub(super) fn read_text_file(path: &Path) -> Result<Piece> {
    let mut bytes = Vec::new();
    std::io::Read::read_to_end(&mut super::open(path)?, &mut bytes)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let progress = bytes.len() as u64;
    let text = String::from_utf8(bytes).map_err(|e| {
        not_utf8(
            &path.display().to_string(),
            e.utf8_error().valid_up_to() as u64,
        )
    })?;
    Ok(Piece { text, progress })
}

/// A single document read in chunks that end at GPT-2 pre-token boundaries.
pub(super) struct TextChunks<R> {
    reader: R,
    name: String,
    buf: Vec<u8>,
    /// Byte offset in the source of `buf[0]`.
    offset: u64,
    eof: bool,
    failed: bool,
}

impl<R: Read> TextChunks<R> {
    pub(super) fn new(reader: R, name: String) -> Self {
        TextChunks {
            reader,
            name,
            buf: Vec::new(),
            offset: 0,
            eof: false,
            failed: false,
        }
    }

    fn fill_to(&mut self, want: usize) -> Result<()> {
        while !self.eof && self.buf.len() < want {
            let missing = (want - self.buf.len()) as u64;
            let read = (&mut self.reader)
                .take(missing)
                .read_to_end(&mut self.buf)
                .with_context(|| format!("cannot read {}", self.name))?;
            self.eof = read == 0;
        }
        Ok(())
    }

    fn next_chunk(&mut self) -> Result<Option<Piece>> {
        let mut want = CHUNK_BYTES;
        loop {
            self.fill_to(want)?;
            if self.buf.is_empty() {
                return Ok(None);
            }
            let split = if self.eof {
                Some(self.buf.len())
            } else {
                pretoken_split(&self.buf)
            };
            match split {
                Some(at) => return self.take(at).map(Some),
                None if want >= MAX_CHUNK_BYTES => {
                    let at = char_split(&self.buf);
                    return self.take(at).map(Some);
                }
                None => want *= 2,
            }
        }
    }

    fn take(&mut self, at: usize) -> Result<Piece> {
        let bytes: Vec<u8> = self.buf.drain(..at).collect();
        let start = self.offset;
        self.offset += at as u64;
        let text = String::from_utf8(bytes)
            .map_err(|e| not_utf8(&self.name, start + e.utf8_error().valid_up_to() as u64))?;
        Ok(Piece {
            text,
            progress: at as u64,
        })
    }
}

impl<R: Read> Iterator for TextChunks<R> {
    type Item = Result<Piece>;

    fn next(&mut self) -> Option<Result<Piece>> {
        if self.failed {
            return None;
        }
        let next = self.next_chunk().transpose();
        self.failed = matches!(next, Some(Err(_)));
        next
    }
}

/// The last position just before a line break (`\n` or `\r`) that follows
/// printable ASCII. GPT-2's pre-tokenizer ends a token at such a position, and it
/// has no look-behind, so the text after it tokenizes the same on its own.
fn pretoken_split(buf: &[u8]) -> Option<usize> {
    (1..buf.len()).rev().find(|&i| is_pretoken_boundary(buf, i))
}

fn is_pretoken_boundary(buf: &[u8], i: usize) -> bool {
    matches!(buf[i], b'\n' | b'\r') && buf[i - 1].is_ascii_graphic()
}

/// A split before the last character that starts in `buf` (may cut a BPE token).
fn char_split(buf: &[u8]) -> usize {
    let is_continuation = |b: u8| b & 0xC0 == 0x80;
    (buf.len().saturating_sub(4)..buf.len())
        .rev()
        .find(|&i| i > 0 && !is_continuation(buf[i]))
        .unwrap_or(buf.len())
}

#[cfg(test)]
mod tests {
    use super::super::texts;
    use super::super::SHAKESPEARE_TEXT;
    use super::*;
    use crate::data::readers::{ProgressUnit, Source};
    use crate::data::testutil::TempDir;
    use std::io::Cursor;

    #[test]
    fn txt_file_is_one_document_in_exact_chunks() {
        let dir = TempDir::new("readers-txt");
        let line = "All: Speak, speak.\nFirst:\n  indented line\n\n";
        let text = line.repeat(40_000); // ~1.4 MB, several chunks
        let path = dir.write("one.txt", &text);
        let source = Source::resolve(path.to_str().unwrap(), "text").unwrap();
        assert!(source.is_single_document());
        let chunks = texts(&source);
        assert!(chunks.len() >= 5, "{} chunks", chunks.len());
        assert_eq!(chunks.concat(), text);
        for chunk in &chunks[1..] {
            assert!(chunk.starts_with('\n'), "chunks are cut before a newline");
        }
        assert_eq!(
            source.progress_total().unwrap(),
            (text.len() as u64, ProgressUnit::Bytes)
        );
    }

    #[test]
    fn chunked_gpt2_encoding_equals_whole_encoding() {
        let t = crate::data::Tokenizer::gpt2();
        let mut text = SHAKESPEARE_TEXT[..60_000].to_string();
        text.push_str("x\n\nA b \nC\t\nD  \n\n E.\nF\r\nG'\n's 12\n34\r\n\r\n5é\nx!\n ");
        let bytes = text.as_bytes();
        let mut cuts: Vec<usize> = (1..bytes.len())
            .filter(|&i| is_pretoken_boundary(bytes, i))
            .collect();
        assert!(cuts.len() > 1_000, "{} cut points", cuts.len());
        cuts.push(bytes.len());
        let mut start = 0;
        let mut chunked = Vec::new();
        for cut in cuts {
            chunked.extend(t.encode(&text[start..cut]).unwrap());
            start = cut;
        }
        assert_eq!(chunked, t.encode(&text).unwrap());
    }

    #[test]
    fn no_newline_text_is_cut_on_char_boundaries() {
        let text = "é".repeat(MAX_CHUNK_BYTES / 2 + 10); // 2 bytes each, no newline
        let chunks: Vec<String> = TextChunks::new(Cursor::new(text.as_bytes()), "x".into())
            .map(|p| p.unwrap().text)
            .collect();
        assert_eq!(chunks.len(), 2);
        assert_eq!(chunks.concat(), text);
    }

    #[test]
    fn non_utf8_names_file_offset_and_iconv() {
        let dir = TempDir::new("readers-latin1");
        let mut bytes = b"caf".to_vec();
        bytes.push(0xE9); // Latin-1 é
        let path = dir.write("latin1.txt", &bytes);
        let source = Source::TextFile(path);
        let err = source
            .pieces()
            .unwrap()
            .next()
            .unwrap()
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("latin1.txt") && err.contains("offset 3"),
            "{err}"
        );
        assert!(err.contains("iconv"), "{err}");
    }
}
