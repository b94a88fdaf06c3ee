//! A model written once over a `parallelize::Plan`: on 2 ranks with column- and row-wise styles by path,
//! its output and its input's gradient equal the same code on one rank (tch's own layers); paths no
//! style matches get tch's layers; a style that cannot apply is named. Model code that takes no plan
//! builds the same layers while the plan is entered.
use crate::common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tch::{nn, nn::Module, Device, Kind, Tensor};
use tch_dist::parallelize::{Embedding, Linear, Plan, Style};

static GENERATOR: Mutex<()> = Mutex::new(());

/// Embedding → fc (colwise) → gelu → proj (rowwise) → out (no style), the same code for every plan:
/// `plan`'s methods, or (`None`) the free functions that read the entered plan.
fn forward(plan: Option<&Plan>, ids: &Tensor) -> (Vec<String>, Tensor, Tensor) {
    let vs = nn::VarStore::new(Device::Cpu);
    let linear = |p: &nn::Path, i, o| match plan {
        Some(plan) => plan.linear(p, i, o, Default::default()).unwrap(),
        None => tch_dist::nn::linear(p, i, o, Default::default()),
    };
    let (emb, fc, proj, out) = {
        let _g = GENERATOR.lock().unwrap_or_else(|e| e.into_inner());
        tch::manual_seed(11);
        let r = vs.root();
        let tok = &r / "tok";
        (
            match plan {
                Some(plan) => plan.embedding(&tok, 16, 8, Default::default()).unwrap(),
                None => tch_dist::nn::embedding(&tok, 16, 8, Default::default()),
            },
            linear(&(&r / "mlp" / "fc"), 8, 32),
            linear(&(&r / "mlp" / "proj"), 32, 8),
            linear(&(&r / "out"), 8, 4),
        )
    };
    let kinds = [
        match &emb {
            Embedding::Local(_) => "local",
            Embedding::Vocab(_) => "vocab",
        },
        kind(&fc),
        kind(&proj),
        kind(&out),
    ];
    let x = emb.forward(ids).detach().set_requires_grad(true);
    let y = out.forward(&proj.forward(&fc.forward(&x).gelu("none")));
    y.square().sum(Kind::Float).backward();
    (kinds.iter().map(|s| s.to_string()).collect(), y.detach(), x.grad())
}

fn kind(l: &Linear) -> &'static str {
    match l {
        Linear::Local(_) => "local",
        Linear::Column(_) => "column",
        Linear::Row(_) => "row",
    }
}

#[test]
fn one_model_source_on_two_ranks_computes_what_it_does_on_one() {
    let _alone = common::alone();
    let ids = || Tensor::from_slice(&[1i64, 5, 9, 15, 0, 7]).view([2, 3]);
    let (kinds, want_y, want_gx) = forward(Some(&Plan::new()), &ids());
    assert!(kinds.iter().all(|k| k == "local"), "{kinds:?}");
    let got = common::run_threads(2, Duration::from_secs(60), move |pg| {
        let plan = Plan::over_group(Arc::new(pg))
            .style("tok", Style::rowwise())
            .style("*.fc", Style::colwise())
            .style("*.proj", Style::rowwise());
        let explicit = forward(Some(&plan), &ids());
        let entered = {
            let _plan = plan.enter();
            forward(None, &ids())
        };
        [explicit, entered]
    });
    for (rank, (kinds, y, gx)) in got.into_iter().flatten().enumerate().map(|(i, r)| (i / 2, r)) {
        assert_eq!(kinds, &["vocab", "column", "row", "local"], "rank {rank}");
        // float32 sums split over ranks, and in whatever blocking the BLAS picks under load (seen: 2 ulp
        // of the largest element): a tolerance relative to each tensor's scale
        for (what, got, want) in [("output", &y, &want_y), ("input gradient", &gx, &want_gx)] {
            let (d, scale) = ((got - want).abs().max().double_value(&[]), want.abs().max().double_value(&[]));
            assert!(d <= 1e-6 * scale.max(1.0), "rank {rank}: {what} differs by {d:e} (largest element {scale})");
        }
    }
}

/// Patterns written for another model's names (`*.attn.wq`) or with a typo would leave those layers whole
/// on every rank, training as if tensor parallelism were on: `finish` names the pattern and the closest
/// paths, on every rank; `allow_unmatched_styles` accepts it.
#[test]
fn a_style_pattern_that_matches_no_layer_is_an_error_naming_the_closest_paths() {
    let _alone = common::alone();
    let errs = common::run_threads(2, Duration::from_secs(30), |pg| {
        let plan =
            Plan::over_group(Arc::new(pg)).style("*.attn.q", Style::colwise()).style("*.attn.wo", Style::rowwise());
        let vs = nn::VarStore::new(Device::Cpu);
        // ranks are threads here: one seed and one generator at a time, as processes would have
        let (q, o) = {
            let _g = GENERATOR.lock().unwrap_or_else(|e| e.into_inner());
            tch::manual_seed(3);
            let q = plan.linear(&(vs.root() / "block0" / "attn" / "q"), 8, 8, Default::default()).unwrap();
            let o = plan.linear(&(vs.root() / "block0" / "attn" / "o"), 8, 8, Default::default()).unwrap();
            let _ = nn::linear(vs.root() / "block1" / "attn" / "q", 8, 8, Default::default());
            (kind(&q), kind(&o))
        };
        let err = plan.finish(&vs, ()).err().map(|e| e.to_string()).unwrap_or_default();
        let nothing = Plan::over_group(plan.tp_group().unwrap().clone()).style("*.attn.q", Style::colwise());
        let none_built = nothing.finish(&vs, ()).err().map(|e| e.to_string()).unwrap_or_default();
        let accepted = plan.clone().allow_unmatched_styles().finish(&vs, ()).is_ok();
        let two = plan.clone().style("*.mlp.fc", Style::colwise());
        let two = two.finish(&vs, ()).err().map(|e| e.to_string()).unwrap_or_default();
        let by_hand = plan.clone().style("block1.attn.q", Style::colwise());
        let by_hand = by_hand.finish(&vs, ()).err().map(|e| e.to_string()).unwrap_or_default();
        (q, o, err, none_built, accepted, two, by_hand)
    });
    for (rank, (q, o, err, none_built, accepted, two, by_hand)) in errs.into_iter().enumerate() {
        // every pattern that matched nothing is named, not only the first
        assert!(two.contains("2 style patterns (\"*.attn.wo\" (row-wise), \"*.mlp.fc\" (column-wise))"), "{two}");
        assert!(two.contains("for \"*.mlp.fc\" (column-wise): the closest layer paths are "), "{two}");
        // a layer the VarStore has but the plan did not build (tch's nn::linear) is named as such
        assert!(by_hand.contains("the VarStore has a layer at block1.attn.q, not built through the plan"), "{by_hand}");
        assert_eq!((q, o), ("column", "local"), "rank {rank}");
        assert!(err.contains("\"*.attn.wo\" (row-wise) matched no layer built through the plan"), "rank {rank}: {err}");
        assert!(err.contains("the closest layer paths are block0.attn.o"), "rank {rank}: {err}");
        assert!(none_built.contains("no layer was built through the plan"), "rank {rank}: {none_built}");
        assert!(accepted, "rank {rank}: allow_unmatched_styles did not accept the plan");
    }
}

/// A seed per rank under tensor parallelism draws different replicated variables on the ranks, which then
/// train different models: `finish` names the first one that differs; with one seed it passes.
#[test]
fn replicated_variables_that_differ_between_tensor_parallel_ranks_are_named_at_finish() {
    let _alone = common::alone();
    let outs = common::run_threads(2, Duration::from_secs(30), |pg| {
        let rank = pg.rank() as i64;
        let pg = Arc::new(pg);
        let build = |seed: i64| {
            let plan = Plan::over_group(pg.clone()).style("*.fc", Style::colwise()).style("*.proj", Style::rowwise());
            let vs = nn::VarStore::new(Device::Cpu);
            {
                let _g = GENERATOR.lock().unwrap_or_else(|e| e.into_inner());
                tch::manual_seed(seed);
                let r = vs.root();
                plan.embedding(&(&r / "tok"), 16, 8, Default::default()).unwrap();
                plan.linear(&(&r / "mlp" / "fc"), 8, 32, Default::default()).unwrap();
                plan.linear(&(&r / "mlp" / "proj"), 32, 8, nn::LinearConfig { bias: false, ..Default::default() })
                    .unwrap();
            }
            plan.finish(&vs, ()).err().map(|e| e.to_string())
        };
        (build(42), build(42 + rank))
    });
    for (rank, (same, per_rank)) in outs.into_iter().enumerate() {
        assert_eq!(same, None, "rank {rank}: one seed on both ranks was refused");
        let err = per_rank.unwrap_or_default();
        // mlp.fc's rows are split (each rank its own); tok is replicated: the one named
        assert!(err.contains("variable tok.weight") && err.contains("ranks 0 and 1"), "rank {rank}: {err}");
        assert!(err.contains("same seed"), "rank {rank}: {err}");
    }
}

/// Attention with a fused QKV projection read by `chunk(3, -1)` (GPT-2's `c_attn`, tch-rs's Llama), heads
/// viewed as `-1`: split by `Style::colwise_fused(3)` over 2 ranks, each rank holds its heads of q, k and v
/// and the output and the input's gradient equal one process's. A plain column-wise style on that name is
/// refused, naming the path and the fused style; `colwise_unfused` says it is not fused.
fn fused_attention(plan: &Plan, x: &Tensor) -> tch_dist::Result<(Tensor, Tensor)> {
    let vs = nn::VarStore::new(Device::Cpu);
    let (d, heads) = (8i64, 4i64);
    let (c_attn, c_proj) = {
        let _g = GENERATOR.lock().unwrap_or_else(|e| e.into_inner());
        tch::manual_seed(5);
        let r = vs.root() / "attn";
        (
            plan.linear(&(&r / "c_attn"), d, 3 * d, Default::default())?,
            plan.linear(&(&r / "c_proj"), d, d, Default::default())?,
        )
    };
    let x = x.detach().set_requires_grad(true);
    let (b, t, _) = x.size3()?;
    let qkv = c_attn.forward(&x).chunk(3, -1);
    let heads_of = |y: &Tensor| y.view([b, t, -1, d / heads]).transpose(1, 2);
    let (q, k, v) = (heads_of(&qkv[0]), heads_of(&qkv[1]), heads_of(&qkv[2]));
    let att = Tensor::scaled_dot_product_attention(&q, &k, &v, None::<Tensor>, 0.0, true, None, false);
    let y = c_proj.forward(&att.transpose(1, 2).contiguous().view([b, t, -1]));
    y.square().sum(Kind::Float).backward();
    Ok((y.detach(), x.grad()))
}

#[test]
fn a_fused_qkv_projection_splits_by_heads_with_the_fused_style() {
    let _alone = common::alone();
    let x = || Tensor::randn([2, 5, 8], (Kind::Float, Device::Cpu));
    let x0 = {
        let _g = GENERATOR.lock().unwrap_or_else(|e| e.into_inner());
        tch::manual_seed(9);
        x()
    };
    let (want_y, want_gx) = fused_attention(&Plan::new(), &x0).unwrap();
    let data = Vec::<f32>::try_from(x0.view([-1])).unwrap();
    let got = common::run_threads(2, Duration::from_secs(60), move |pg| {
        let xs = Tensor::from_slice(&data).view([2, 5, 8]);
        let pg = Arc::new(pg);
        let styled = |s: Style| Plan::over_group(pg.clone()).style("*.c_attn", s).style("*.c_proj", Style::rowwise());
        let fused = fused_attention(&styled(Style::colwise_fused(3)), &xs).unwrap();
        let plain = fused_attention(&styled(Style::colwise()), &xs).err().map(|e| e.to_string()).unwrap_or_default();
        let unfused = fused_attention(&styled(Style::colwise_unfused()), &xs).unwrap();
        (fused, plain, unfused.0)
    });
    for (rank, ((y, gx), plain, unfused)) in got.into_iter().enumerate() {
        for (what, got, want) in [("output", &y, &want_y), ("input gradient", &gx, &want_gx)] {
            let (d, scale) = ((got - want).abs().max().double_value(&[]), want.abs().max().double_value(&[]));
            assert!(d <= 1e-6 * scale.max(1.0), "rank {rank}: {what} differs by {d:e} (largest element {scale})");
        }
        assert!(plain.contains("attn.c_attn") && plain.contains("Style::colwise_fused(3)"), "rank {rank}: {plain}");
        // declared unfused: split as one block, each rank a mix of q, k and v rows (what the fused style fixes)
        let off = (&unfused - &want_y).abs().max().double_value(&[]);
        assert!(off > 1e-3, "rank {rank}: a one-block split of a fused layer matched by chance ({off:e})");
    }
}

/// A row-wise layer given the whole input (the column-wise style before it missing, as a typo leaves it)
/// fails naming its path, its style and the features it expects, not with a bare matrix-shape error.
#[test]
fn a_split_layer_given_the_wrong_input_names_its_path_and_style() {
    let _alone = common::alone();
    let errs = common::run_threads(2, Duration::from_secs(30), |pg| {
        let plan = Plan::over_group(Arc::new(pg)).style("*.proj", Style::rowwise()).style("*.fc", Style::colwise());
        let vs = nn::VarStore::new(Device::Cpu);
        let (fc, proj) = {
            let _g = GENERATOR.lock().unwrap_or_else(|e| e.into_inner());
            tch::manual_seed(1);
            let fc = nn::linear(vs.root() / "mlp" / "fc", 8, 32, Default::default()); // not through the plan
            (fc, plan.linear(&(vs.root() / "mlp" / "proj"), 32, 8, Default::default()).unwrap())
        };
        let x = Tensor::ones([2, 8], (Kind::Float, Device::Cpu));
        proj.f_forward(&fc.forward(&x)).unwrap_err().to_string()
    });
    for (rank, e) in errs.into_iter().enumerate() {
        assert!(e.contains("mlp.proj (row-wise over 2 ranks)"), "rank {rank}: {e}");
        assert!(e.contains("input [2, 32]") && e.contains("this rank's 16 of the layer's 32"), "rank {rank}: {e}");
    }
}

/// A plan that synchronises batch norms while the model's batch norms are built around it (`let _ =
/// plan.enter()` drops the guard at once) would train with each rank's statistics: `finish` refuses it,
/// naming the slip; with the guard held it finishes.
#[test]
fn a_sync_batch_norm_that_no_batch_norm_took_is_refused_at_finish() {
    let _alone = common::alone();
    let outs = common::run_threads(2, Duration::from_secs(30), |pg| {
        let pg = Arc::new(pg);
        let build = |hold: bool| {
            let plan = Plan::over_group(pg.clone()).sync_batch_norm(pg.clone());
            let vs = nn::VarStore::new(Device::Cpu);
            let _g = GENERATOR.lock().unwrap_or_else(|e| e.into_inner());
            tch::manual_seed(2);
            let bn = if hold {
                let _plan = plan.enter();
                tch_dist::nn::f_batch_norm2d(vs.root() / "bn", 4, Default::default()).map(|_| ())
            } else {
                let _ = plan.enter();
                tch_dist::nn::f_batch_norm2d(vs.root() / "bn", 4, Default::default()).map(|_| ())
            };
            bn.unwrap();
            drop(_g);
            plan.finish(&vs, ()).err().map(|e| e.to_string())
        };
        (build(false), build(true))
    });
    for (rank, (dropped, held)) in outs.into_iter().enumerate() {
        let e = dropped.unwrap_or_default();
        assert!(
            e.contains("no batch norm was built through it") && e.contains("let _ = plan.enter()"),
            "rank {rank}: {e}"
        );
        assert_eq!(held, None, "rank {rank}");
    }
}

#[test]
fn an_embedding_split_column_wise_is_refused_with_its_path() {
    let _alone = common::alone();
    let errs = common::run_threads(2, Duration::from_secs(30), |pg| {
        let plan = Plan::over_group(Arc::new(pg)).style("emb*", Style::colwise());
        let vs = nn::VarStore::new(Device::Cpu);
        plan.embedding(&(vs.root() / "emb"), 8, 4, Default::default()).unwrap_err().to_string()
    });
    assert!(errs[0].contains("emb") && errs[0].contains("row-wise"), "{}", errs[0]);
}

/// The plan's FSDP builds one model: a second `finish` is refused, and so is a model whose variables
/// live in another VarStore than the one the plan shards; a block no variable lives under is named.
#[test]
fn the_plans_fsdp_refuses_a_second_model_and_another_var_store() {
    let _alone = common::alone();
    use tch_dist::fsdp::FsdpOptions;
    let store = tch_dist::Store::hash().unwrap();
    let pg = Arc::new(tch_dist::ProcessGroup::new(&store, 0, 1, &Default::default()).unwrap());
    let opts = || FsdpOptions::default().process_group(pg.clone());
    let vs = nn::VarStore::new(Device::Cpu);
    let plan = Plan::new().fully_shard(opts()).unwrap();
    let err = plan.unit(&(vs.root() / "b"), ()).map(|_| ()).unwrap_err().to_string();
    assert!(err.contains("plan.bind(&vs)"), "a unit before the plan has its VarStore: {err}");
    plan.bind(&vs).unwrap();
    let block = plan.unit(&(vs.root() / "b"), nn::linear(vs.root() / "b", 4, 4, Default::default())).unwrap();
    let err = plan.unit(&(vs.root() / "none"), nn::func(|x| x.shallow_clone())).unwrap_err().to_string();
    assert!(err.contains("no parameters under none"), "{err}");
    let model = plan.finish(&vs, block).unwrap();
    let tch_dist::parallelize::Parallel::Fsdp(fsdp) = &model else { panic!("not FSDP") };
    assert_eq!(fsdp.units(), ["b"]);
    // a model with no block built as a unit is one unit, the root: what the plan warns about
    let whole = nn::VarStore::new(Device::Cpu);
    let plan1 = Plan::new().fully_shard(opts()).unwrap();
    let m = plan1.build(&whole, || nn::linear(whole.root() / "b", 4, 4, Default::default())).unwrap();
    let tch_dist::parallelize::Parallel::Fsdp(one) = &m else { panic!("not FSDP") };
    assert_eq!(one.units(), ["root"]);
    let err = plan.finish(&vs, ()).unwrap_err().to_string();
    assert!(err.contains("finished already"), "{err}");

    let other = nn::VarStore::new(Device::Cpu);
    let plan = Plan::new().fully_shard(opts()).unwrap();
    plan.bind(&vs).unwrap();
    let _ = nn::linear(other.root() / "l", 4, 4, Default::default());
    let err = plan.finish(&other, ()).unwrap_err().to_string();
    assert!(err.contains("not the one the plan's FSDP shards"), "{err}");
}

#[test]
fn an_entered_plan_holds_for_its_scope_on_its_thread() {
    let _alone = common::alone();
    let kinds = common::run_threads(2, Duration::from_secs(30), |pg| {
        let plan = Plan::over_group(Arc::new(pg)).style("fc*", Style::colwise());
        let vs = nn::VarStore::new(Device::Cpu);
        let fc = |n: &str| kind(&tch_dist::nn::linear(vs.root() / n, 4, 8, Default::default()));
        let mut seen = vec![fc("fc0")];
        {
            let _plan = plan.enter();
            seen.push(fc("fc1"));
            let other = std::thread::scope(|s| {
                s.spawn(|| kind(&tch_dist::nn::linear(vs.root() / "fc2", 4, 8, Default::default()))).join().unwrap()
            });
            seen.push(other);
            {
                let _none = Plan::new().enter();
                seen.push(fc("fc3"));
            }
            seen.push(fc("fc4"));
        }
        seen.push(fc("fc5"));
        seen
    });
    for k in &kinds {
        // before; entered; another thread; an inner plan; the outer again; after
        assert_eq!(k, &["local", "column", "local", "local", "column", "local"]);
    }
}
