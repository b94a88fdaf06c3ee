//! scikit-learn's copy of the UCI 8x8 handwritten digits (1,797 images), shared by the examples that
//! train on it: where the venv has it, and its pixels (scaled to [0, 1]) and labels.
use std::io::Read;

use tch::{Device, Kind, Tensor};

/// scikit-learn's copy of the UCI digits, found in the torch venv that scripts/setup.sh made.
pub fn default_data() -> Result<std::path::PathBuf, String> {
    let venv =
        std::env::var("TCH_DIST_VENV").map_err(|_| "TCH_DIST_VENV is not set: source scripts/env.sh or pass --data")?;
    let lib = std::path::Path::new(&venv).join("lib");
    for e in std::fs::read_dir(&lib).map_err(|e| format!("{}: {e}", lib.display()))?.flatten() {
        let p = e.path().join("site-packages/sklearn/datasets/data/digits.csv.gz");
        if p.exists() {
            return Ok(p);
        }
    }
    Err(format!("digits.csv.gz not found under {}: is scikit-learn installed?", lib.display()))
}

pub fn load(path: &std::path::Path) -> Result<(Tensor, Tensor), Box<dyn std::error::Error>> {
    let mut text = String::new();
    flate2::read::GzDecoder::new(std::fs::File::open(path)?).read_to_string(&mut text)?;
    let (mut xs, mut ys) = (Vec::new(), Vec::new());
    for (n, line) in text.lines().enumerate() {
        let v: Vec<f32> = line
            .split(',')
            .map(|s| s.trim().parse())
            .collect::<Result<_, _>>()
            .map_err(|e| format!("{}:{}: {e}", path.display(), n + 1))?;
        if v.len() != 65 {
            return Err(format!("{}:{}: {} columns, expected 65", path.display(), n + 1, v.len()).into());
        }
        xs.extend(v[..64].iter().map(|p| p / 16.0));
        ys.push(v[64] as i64);
    }
    let n = ys.len() as i64;
    Ok((Tensor::from_slice(&xs).view([n, 64]), Tensor::from_slice(&ys)))
}

/// `(train_x, train_y), (test_x, test_y)`.
pub type Split = ((Tensor, Tensor), (Tensor, Tensor));

/// The same split on every rank: a fixed permutation, `train` images to train on, the rest to test.
pub fn split(x: &Tensor, y: &Tensor, train: i64) -> Split {
    tch::manual_seed(0);
    let n = x.size()[0];
    let perm = Tensor::randperm(n, (Kind::Int64, Device::Cpu));
    let (tr, te) = (perm.narrow(0, 0, train), perm.narrow(0, train, n - train));
    ((x.index_select(0, &tr), y.index_select(0, &tr)), (x.index_select(0, &te), y.index_select(0, &te)))
}
