//! The few Python values PyTorch's flight-recorder dumps hold, written as a pickle (protocol 2, as
//! libtorch writes them), so that `pickle.load` in PyTorch's analyzer reads them.
pub(crate) enum Py {
    None,
    Bool(bool),
    Int(i64),
    Str(String),
    List(Vec<Py>),
    Tuple2(Box<Py>, Box<Py>),
    Dict(Vec<(String, Py)>),
}

impl Py {
    pub(super) fn str(s: impl Into<String>) -> Py {
        Py::Str(s.into())
    }

    /// The whole pickle: protocol header, the value, STOP.
    pub(super) fn to_pickle(&self) -> Vec<u8> {
        let mut out = vec![0x80, 2];
        self.write(&mut out);
        out.push(b'.');
        out
    }

    fn write(&self, out: &mut Vec<u8>) {
        match self {
            Py::None => out.push(b'N'),
            Py::Bool(b) => out.push(if *b { 0x88 } else { 0x89 }),
            Py::Int(v) => match i32::try_from(*v) {
                // BININT: 4 bytes, little-endian, signed
                Ok(small) => {
                    out.push(b'J');
                    out.extend_from_slice(&small.to_le_bytes());
                }
                // LONG1: a length byte, then little-endian two's complement
                Err(_) => {
                    out.extend_from_slice(&[0x8a, 8]);
                    out.extend_from_slice(&v.to_le_bytes());
                }
            },
            Py::Str(s) => write_str(out, s),
            Py::List(items) => {
                out.push(b']');
                if !items.is_empty() {
                    out.push(b'(');
                    for i in items {
                        i.write(out);
                    }
                    out.push(b'e');
                }
            }
            Py::Tuple2(a, b) => {
                a.write(out);
                b.write(out);
                out.push(0x86);
            }
            Py::Dict(items) => {
                out.push(b'}');
                if !items.is_empty() {
                    out.push(b'(');
                    for (k, v) in items {
                        write_str(out, k);
                        v.write(out);
                    }
                    out.push(b'u');
                }
            }
        }
    }
}

/// BINUNICODE: a 4-byte little-endian length, then UTF-8.
fn write_str(out: &mut Vec<u8>, s: &str) {
    out.push(b'X');
    out.extend_from_slice(&(s.len() as u32).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}
