//! AccumulateGrad post-hooks fire once per leaf per backward, after accumulation, in autograd's order; and
//! gradients can live as views of one flat buffer (what DDP's bucket views are), surviving zero_grads.
use std::sync::{Arc, Mutex};

use tch::{nn, nn::Module, Device, Kind, Tensor};
use tch_dist::hooks;

#[test]
fn hooks_fire_in_reverse_layer_order_after_accumulation() {
    let vs = nn::VarStore::new(Device::Cpu);
    let l1 = nn::linear(vs.root() / "l1", 4, 8, Default::default());
    let l2 = nn::linear(vs.root() / "l2", 8, 3, Default::default());
    let order = Arc::new(Mutex::new(Vec::new()));
    let named = [
        ("l1.weight", &l1.ws),
        ("l1.bias", l1.bs.as_ref().unwrap()),
        ("l2.weight", &l2.ws),
        ("l2.bias", l2.bs.as_ref().unwrap()),
    ];
    let mut handles = Vec::new();
    for (name, p) in named {
        let order = order.clone();
        let p2 = Mutex::new(p.shallow_clone()); // Tensor is Send but not Sync
        handles.push(
            hooks::on_grad_accumulated(p, move || {
                // the gradient is already accumulated when the hook runs
                assert!(p2.lock().unwrap().grad().defined());
                order.lock().unwrap().push(name)
            })
            .unwrap(),
        );
    }
    let x = Tensor::randn([5, 4], (Kind::Float, Device::Cpu));
    l2.forward(&l1.forward(&x).relu()).sum(Kind::Float).backward();
    let got = order.lock().unwrap().clone();
    assert_eq!(got.len(), 4);
    assert!(got[..2].iter().all(|n| n.starts_with("l2")), "{got:?}");
    assert!(got[2..].iter().all(|n| n.starts_with("l1")), "{got:?}");
    // dropping the handles removes the hooks
    drop(handles);
    l2.forward(&l1.forward(&x).relu()).sum(Kind::Float).backward();
    assert_eq!(order.lock().unwrap().len(), 4);
}

#[test]
fn grads_as_views_of_a_flat_buffer_accumulate_in_place() {
    let w = Tensor::randn([3, 4], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let flat = Tensor::zeros([20], (Kind::Float, Device::Cpu));
    let view = flat.narrow(0, 4, 12).view([3, 4]);
    hooks::set_grad(&w, Some(&view)).unwrap();
    let ptr = hooks::grad_data_ptr(&w).unwrap();
    assert_eq!(ptr, view.data_ptr() as u64);
    (&w * 2.0).sum(Kind::Float).backward();
    (&w * 3.0).sum(Kind::Float).backward();
    assert_eq!(hooks::grad_data_ptr(&w).unwrap(), ptr, "grad must stay the view");
    let v = Vec::<f32>::try_from(&flat).unwrap();
    assert!(
        v[..4].iter().all(|&x| x == 0.0) && v[4..16].iter().all(|&x| x == 5.0) && v[16..].iter().all(|&x| x == 0.0)
    );
    // tch's own zero_grad calls detach_() and fails on views; ours keeps the view
    hooks::zero_grads(&[w.shallow_clone()]).unwrap();
    assert_eq!(hooks::grad_data_ptr(&w).unwrap(), ptr);
    assert!(Vec::<f32>::try_from(&flat).unwrap().iter().all(|&x| x == 0.0));
    hooks::set_grad(&w, None).unwrap();
    assert_eq!(hooks::grad_data_ptr(&w).unwrap(), 0);
}

#[test]
fn hook_on_a_non_leaf_is_refused() {
    let w = Tensor::randn([3], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let y = &w * 2.0;
    let e = hooks::on_grad_accumulated(&y, || {}).err().expect("must fail");
    assert!(e.to_string().contains("leaf"), "{e}");
}

#[test]
fn a_panicking_hook_does_not_unwind_into_autograd() {
    let w = Tensor::randn([3], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let _h = hooks::on_grad_accumulated(&w, || panic!("boom")).unwrap();
    (&w * 2.0).sum(Kind::Float).backward();
    assert!(w.grad().defined());
}
