"""Isaac Lab 3.0 engine adapter for HoRD-G1 (kit-less Newton/MuJoCo-Warp physics; the contract's `XSim`).

The G1 MJCF (`ssjr.g1_mjcf_path()`) is converted once with Isaac Lab's own MjcfConverter into a USD cached in
`assets/` (git-ignored). One `InteractiveScene` holds N clones of that USD (env spacing 0: every env sits at the
world origin, like Genesis' batched envs; Newton worlds never collide with each other) over a local ground
(an infinite plane, or a Newton heightfield for non-flat terrain). The task computes PD torques itself: every
joint gets an Isaac Lab implicit actuator with zero stiffness/damping (Newton EFFORT mode), so `step(tau)` is a
pure joint-torque step.

Deviations from Isaac Lab / Genesis conventions handled here:
- Isaac Lab 3 quaternions are xyzw; the adapter speaks wxyz (contract).
- Joint/body order: remapped by name (Newton's articulation view happens to use MuJoCo order already, but the
  permutation is built from the articulation's names and checked at start-up).
- Velocities are those of the link frames (origins), matching `d/dt body_pos`, not of the centres of mass.
- Friction: MuJoCo(-Warp) uses the max of the two geoms' friction; the ground's friction is set to 0 so the
  foot shapes' friction IS the ground-foot friction (`set_friction`). Other links keep the asset's friction.
- Joint damping/frictionloss are MuJoCo's passive `dof_damping`/`dof_frictionloss` (Isaac Lab "viscous
  friction" / "friction coefficient"); the actuators' PD gains stay 0.
- `set_body_mass` scales each body's rotational inertia with its mass ratio (same radius of gyration).
- Gravity is per env natively (Newton `Model.gravity` has one row per world, copied into MJWarp's per-world
  `opt.gravity`): no compensating external forces are needed.
- Non-flat terrain: a Newton heightfield (MuJoCo `hfield`, which MJWarp collides with capsules/spheres), plus a
  plane at the lowest terrain height so nothing falls forever outside the terrain patch.
"""
from __future__ import annotations

import contextlib
import hashlib
import pathlib
import shutil
import tempfile
import time

import numpy as np
import torch

import ssjr

_XYZW_FROM_WXYZ = [1, 2, 3, 0]
_WXYZ_FROM_XYZW = [3, 0, 1, 2]
_TORSO = "torso_link"
_FEET = ("left_ankle_roll_link", "right_ankle_roll_link")


def _g1_usd_path() -> pathlib.Path:
    """Convert the G1 MJCF to USD once (Isaac Lab MjcfConverter, MuJoCo physics variant) and cache it.

    Must run before any other USD stage exists in the process (else the converter misses the PhysxJointAPI
    schema). The conversion goes to a temporary folder that is renamed into place: a half-written USD is never
    visible to another process.
    """
    xml = ssjr.g1_mjcf_path()
    digest = hashlib.sha1(xml.read_bytes()).hexdigest()[:10]
    out = ssjr.ASSETS / f"g1_usd_{digest}"
    usd = out / "g1" / "g1.usda"
    if usd.exists():
        return usd
    from isaaclab.sim.converters import MjcfConverter, MjcfConverterCfg

    staging = pathlib.Path(tempfile.mkdtemp(prefix=".g1_usd_", dir=ssjr.ASSETS))
    converter = MjcfConverter(MjcfConverterCfg(asset_path=str(xml), usd_dir=str(staging), fix_base=False,
                                               force_usd_conversion=True, physics_variant="mujoco"))
    if pathlib.Path(converter.usd_path) != staging / "g1" / "g1.usda":
        raise RuntimeError(f"unexpected converter output {converter.usd_path}")
    try:
        staging.rename(out)
    except OSError:  # another process won the race: keep its copy
        shutil.rmtree(staging, ignore_errors=True)
    return usd


def _write_ground_usd(path: pathlib.Path, terrain) -> None:
    """Author the local ground: an infinite collision plane, plus a heightfield-tagged mesh for non-flat terrain."""
    from pxr import Sdf, Usd, UsdGeom, UsdPhysics

    stage = Usd.Stage.CreateNew(str(path))
    UsdGeom.SetStageUpAxis(stage, UsdGeom.Tokens.z)
    UsdGeom.SetStageMetersPerUnit(stage, 1.0)
    root = UsdGeom.Xform.Define(stage, "/Ground")
    stage.SetDefaultPrim(root.GetPrim())
    heights = None if terrain is None else np.asarray(terrain.heights_m, dtype=np.float32)
    plane = UsdGeom.Plane.Define(stage, "/Ground/Plane")
    plane.CreateAxisAttr(UsdGeom.Tokens.z)
    UsdPhysics.CollisionAPI.Apply(plane.GetPrim())
    if heights is not None and np.any(heights != 0.0):
        plane.AddTranslateOp().Set((0.0, 0.0, float(heights.min())))
        nx, ny = heights.shape
        x0, y0 = (float(v) for v in terrain.origin_m)
        xs = x0 + terrain.cell_m * np.arange(nx)
        ys = y0 + terrain.cell_m * np.arange(ny)
        gx, gy = np.meshgrid(xs, ys, indexing="ij")
        points = np.stack([gx, gy, heights], -1).reshape(-1, 3)
        i, j = np.meshgrid(np.arange(nx - 1), np.arange(ny - 1), indexing="ij")
        a = (i * ny + j).ravel()
        # two counter-clockwise (seen from +z) triangles per cell: the heightfield rasterizer reads triangles only
        tris = np.concatenate([np.stack([a, a + ny, a + ny + 1], -1), np.stack([a, a + ny + 1, a + 1], -1)])
        mesh = UsdGeom.Mesh.Define(stage, "/Ground/Terrain")
        mesh.CreatePointsAttr(points.astype(np.float32).tolist())
        mesh.CreateFaceVertexCountsAttr([3] * len(tris))
        mesh.CreateFaceVertexIndicesAttr(tris.ravel().tolist())
        UsdPhysics.CollisionAPI.Apply(mesh.GetPrim())
        # Isaac Lab's Newton manager rasterizes a mesh tagged like this into a Newton heightfield (MuJoCo hfield).
        mesh.GetPrim().CreateAttribute("newton:heightfield:resolution", Sdf.ValueTypeNames.Float).Set(
            float(terrain.cell_m))
    stage.GetRootLayer().Save()


class IsaacLabSim:
    """Contract engine adapter on Isaac Lab 3.0 (Newton + MuJoCo-Warp, kit-less). One instance per process at a
    time (Isaac Lab's SimulationContext is a singleton); `close()` frees it for the next one."""

    dof_names = ssjr.DOF_NAMES
    body_names = ssjr.BODY_NAMES

    def __init__(self, num_envs: int, device: str, terrain, dt_s: float = 0.005, physx: bool = False):
        from isaaclab.app import launch_simulation
        import isaaclab.sim as sim_utils

        if sim_utils.SimulationContext.instance() is not None:
            raise RuntimeError("an Isaac Lab SimulationContext already exists in this process: close() it first")
        t0 = time.perf_counter()
        self.num_envs, self.device, self.dt_s = num_envs, torch.device(device), dt_s
        if physx:  # needs Isaac Sim (Kit); not installable on this CPU machine
            from isaaclab_physx.physics import PhysxCfg
            physics = PhysxCfg()
        else:
            from isaaclab_newton.physics import MJWarpSolverCfg, NewtonCfg
            physics = NewtonCfg(solver_cfg=MJWarpSolverCfg(njmax=300, nconmax=60, ls_iterations=50,
                                                           cone="pyramidal", integrator="implicitfast"))
        sim_cfg = sim_utils.SimulationCfg(dt=dt_s, device=str(device), physics=physics)
        self._launch = contextlib.ExitStack()
        self._launch.enter_context(launch_simulation(sim_cfg, {"headless": True, "device": str(device)}))
        usd = _g1_usd_path()  # before any other stage
        self._tmp = tempfile.TemporaryDirectory(prefix="hord_isaaclab_")
        ground_usd = pathlib.Path(self._tmp.name) / "ground.usda"
        _write_ground_usd(ground_usd, terrain)

        from isaaclab.actuators import ImplicitActuatorCfg
        from isaaclab.assets import ArticulationCfg, AssetBaseCfg
        from isaaclab.scene import InteractiveScene, InteractiveSceneCfg

        sim_utils.create_new_stage()
        self.sim = sim_utils.SimulationContext(sim_cfg)
        scene_cfg = InteractiveSceneCfg(num_envs=num_envs, env_spacing=0.0)
        scene_cfg.ground = AssetBaseCfg(prim_path="/World/ground", spawn=sim_utils.UsdFileCfg(usd_path=str(ground_usd)))
        scene_cfg.robot = ArticulationCfg(
            prim_path="{ENV_REGEX_NS}/Robot", spawn=sim_utils.UsdFileCfg(usd_path=str(usd)),
            # the USD keeps the MJCF pelvis offset (0.793 m): a spawn position of 0 puts the pelvis there
            init_state=ArticulationCfg.InitialStateCfg(pos=(0.0, 0.0, 0.0)),
            actuators={"g1": ImplicitActuatorCfg(joint_names_expr=[".*"], stiffness=0.0, damping=0.0)})
        self.scene = InteractiveScene(scene_cfg)
        self.sim.reset()
        self.robot = self.scene["robot"]
        self._build_maps()
        self._model = self.sim.physics_manager.get_model()
        self._bind_shapes()
        mass_isaac = self.robot.data.body_mass.torch.clone()
        self.default_body_mass_kg = mass_isaac[:, self._body_perm].to(self.device)
        self._default_inertia = self.robot.data.body_inertia.torch.clone()
        self._default_mass_isaac = mass_isaac
        self._default_com = self.robot.data.body_com_pos_b.torch.clone()
        self._all_ids = torch.arange(num_envs, dtype=torch.int32, device=self.device)
        self.build_s = time.perf_counter() - t0

    # ----- set-up helpers -----
    def _build_maps(self) -> None:
        """MuJoCo-order index -> Isaac Lab index, by name (never from a hard-coded table)."""
        joints, bodies = list(self.robot.joint_names), list(self.robot.body_names)
        if sorted(joints) != sorted(self.dof_names) or sorted(bodies) != sorted(self.body_names):
            raise RuntimeError(f"G1 USD names differ from ssjr: joints {joints}, bodies {bodies}")
        self._dof_perm = torch.tensor([joints.index(n) for n in self.dof_names], device=self.device)
        self._dof_inv = torch.argsort(self._dof_perm)
        self._body_perm = torch.tensor([bodies.index(n) for n in self.body_names], device=self.device)
        self._torso_isaac = bodies.index(_TORSO)

    def _bind_shapes(self) -> None:
        """Ground friction -> 0 (contact friction = max of the pair = the foot's); bind the foot shapes' mu."""
        from newton import ModelFlags
        import warp as wp

        model = self._model
        static = np.flatnonzero(model.shape_body.numpy() == -1)
        for name in ("shape_material_mu", "shape_material_mu_torsional", "shape_material_mu_rolling"):
            arr = getattr(model, name, None)
            if arr is not None:
                values = arr.numpy()
                values[static] = 0.0
                arr.assign(values)
        self.sim.physics_manager.add_model_change(ModelFlags.SHAPE_PROPERTIES)
        view = self.robot.root_view
        self._shape_mu = wp.to_torch(view.get_attribute("shape_material_mu", model)[:, 0])
        backend_bodies = list(self.robot.backend_body_names)
        self._foot_shapes = torch.tensor(
            [s for foot in _FEET for s in view.body_shapes[backend_bodies.index(foot)]], device=self.device)
        self._model_flags = ModelFlags

    def _ids(self, env_ids) -> torch.Tensor:
        return torch.as_tensor(env_ids, device=self.device).to(torch.int32)

    # ----- the contract -----
    @property
    def isaac_index_of_dof(self) -> torch.Tensor:
        """Element i = Isaac Lab joint index of MuJoCo joint i (`q_mj = q_isaac[:, isaac_index_of_dof]`)."""
        return self._dof_perm

    @property
    def isaac_index_of_body(self) -> torch.Tensor:
        """Element i = Isaac Lab body index of MuJoCo body i."""
        return self._body_perm

    def step(self, tau_Nm: torch.Tensor) -> None:
        """Apply joint torques [N,29] (MuJoCo order) for one physics step, then advance one step."""
        self.robot.actuators.target_command.set_effort_index(
            value=tau_Nm.to(self.device, torch.float32)[:, self._dof_inv].contiguous())
        self.robot.write_data_to_sim()
        self.sim.step(render=False)
        self.robot.update(self.dt_s)

    def dof_state(self):
        data = self.robot.data
        return data.joint_pos.torch[:, self._dof_perm], data.joint_vel.torch[:, self._dof_perm]

    def root_state(self):
        pose = self.robot.data.root_link_pose_w.torch
        vel = self.robot.data.root_link_vel_w.torch
        return pose[:, :3].clone(), pose[:, 3:7][:, _WXYZ_FROM_XYZW], vel[:, :3].clone(), vel[:, 3:].clone()

    def body_state(self):
        pose = self.robot.data.body_link_pose_w.torch[:, self._body_perm]
        vel = self.robot.data.body_link_vel_w.torch[:, self._body_perm]
        return pose[..., :3], pose[..., 3:7][..., _WXYZ_FROM_XYZW], vel[..., :3], vel[..., 3:]

    def write_state(self, env_ids, root_pos, root_quat, root_lin_vel, root_ang_vel, q, qd) -> None:
        ids = self._ids(env_ids)
        f32 = dict(device=self.device, dtype=torch.float32)
        pose = torch.cat([root_pos.to(**f32), root_quat.to(**f32)[:, _XYZW_FROM_WXYZ]], -1).contiguous()
        vel = torch.cat([root_lin_vel.to(**f32), root_ang_vel.to(**f32)], -1).contiguous()
        self.robot.write_root_link_pose_to_sim_index(root_pose=pose, env_ids=ids)
        self.robot.write_root_link_velocity_to_sim_index(root_velocity=vel, env_ids=ids)
        self.robot.write_joint_state_to_sim_index(position=q.to(**f32)[:, self._dof_inv].contiguous(),
                                                  velocity=qd.to(**f32)[:, self._dof_inv].contiguous(), env_ids=ids)

    def set_root_velocity(self, env_ids, lin_vel_w, ang_vel_w) -> None:
        vel = torch.cat([lin_vel_w, ang_vel_w], -1).to(self.device, torch.float32).contiguous()
        self.robot.write_root_link_velocity_to_sim_index(root_velocity=vel, env_ids=self._ids(env_ids))

    def set_gravity(self, env_ids, g_w) -> None:
        """Per-env gravity [n,3]: Newton keeps one gravity row per world (MJWarp `opt.gravity` is per world)."""
        import warp as wp

        gravity = wp.to_torch(self._model.gravity)  # [num_worlds + 1 (global), 3], a view
        gravity[torch.as_tensor(env_ids, device=gravity.device).long()] = g_w.to(gravity.device, torch.float32)
        self.sim.physics_manager.add_model_change(self._model_flags.MODEL_PROPERTIES)

    def set_body_mass(self, env_ids, mass_kg) -> None:
        """Masses [n,30] (MuJoCo body order); inertias scale with the same per-body ratio."""
        ids = self._ids(env_ids)
        m = torch.empty_like(mass_kg, dtype=torch.float32, device=self.device)
        m[:, self._body_perm] = mass_kg.to(self.device, torch.float32)
        ratio = m / self._default_mass_isaac[ids.long()]
        self.robot.set_masses_index(masses=m.contiguous(), env_ids=ids)
        self.robot.set_inertias_index(
            inertias=(self._default_inertia[ids.long()] * ratio[..., None]).contiguous(), env_ids=ids)

    def set_com_offset(self, env_ids, offset_m) -> None:
        """Torso centre-of-mass offset [n,3] (body frame) from the asset's COM."""
        ids = self._ids(env_ids)
        com = self._default_com[ids.long(), self._torso_isaac] + offset_m.to(self.device, torch.float32)
        self.robot.set_coms_index(coms=com[:, None].contiguous(), body_ids=[self._torso_isaac], env_ids=ids)

    def set_friction(self, env_ids, mu) -> None:
        """Ground-foot friction coefficient [n] (written on every foot collision shape)."""
        rows = torch.as_tensor(env_ids, device=self.device).long()
        self._shape_mu[rows[:, None], self._foot_shapes] = mu.to(self.device, torch.float32)[:, None]
        self.sim.physics_manager.add_model_change(self._model_flags.SHAPE_PROPERTIES)

    def set_joint_params(self, env_ids, armature, damping, frictionloss) -> None:
        """Per-env joint armature [kg m^2], passive damping [N m s/rad], dry friction [N m]; [n,29] MuJoCo order."""
        ids = self._ids(env_ids)
        f32 = dict(device=self.device, dtype=torch.float32)
        self.robot.write_joint_armature_to_sim_index(armature=armature.to(**f32)[:, self._dof_inv].contiguous(),
                                                     env_ids=ids)
        self.robot.write_joint_viscous_friction_coefficient_to_sim_index(
            joint_viscous_friction_coeff=damping.to(**f32)[:, self._dof_inv].contiguous(), env_ids=ids)
        self.robot.write_joint_friction_coefficient_to_sim_index(
            joint_friction_coeff=frictionloss.to(**f32)[:, self._dof_inv].contiguous(), env_ids=ids)

    def nan_envs(self) -> torch.Tensor:
        data = self.robot.data
        bad = ~torch.isfinite(data.joint_pos.torch).all(-1) | ~torch.isfinite(data.joint_vel.torch).all(-1)
        bad |= ~torch.isfinite(data.root_link_pose_w.torch).all(-1) | ~torch.isfinite(data.root_com_vel_w.torch).all(-1)
        return bad

    def close(self) -> None:
        """Release the simulation so another IsaacLabSim can be built in this process."""
        import isaaclab.sim as sim_utils

        self.sim.stop()
        sim_utils.SimulationContext.clear_instance()
        self._launch.close()
        self._tmp.cleanup()


def isaaclab_raw_steps_per_s(num_envs: int, steps: int) -> float:
    """Raw engine speed: physics steps (0.005 s) x envs per second for the G1 held by inline PD torques toward
    a fixed bent-knee stance on flat ground (no task logic; build and the first, compiling, steps excluded)."""
    sim = IsaacLabSim(num_envs, "cpu", None)
    try:
        stance = torch.zeros(num_envs, 29)
        for name, value in (("hip_pitch", -0.312), ("knee", 0.669), ("ankle_pitch", -0.363), ("elbow", 0.6)):
            for side in ("left", "right"):
                stance[:, ssjr.DOF_NAMES.index(f"{side}_{name}_joint")] = value
        kp = torch.tensor([200.0 if ("hip" in n or "knee" in n or "waist" in n) else 60.0 for n in ssjr.DOF_NAMES])
        kd = 0.05 * kp
        sim.set_joint_params(range(num_envs), torch.full((num_envs, 29), 0.02), torch.zeros(num_envs, 29),
                             torch.zeros(num_envs, 29))
        zeros3 = torch.zeros(num_envs, 3)
        quat = torch.tensor([[1.0, 0, 0, 0]]).repeat(num_envs, 1)
        sim.write_state(range(num_envs), torch.tensor([[0, 0, 0.78]]).repeat(num_envs, 1), quat, zeros3, zeros3,
                        stance, torch.zeros(num_envs, 29))

        def pd_step():
            q, qd = sim.dof_state()
            sim.step((kp * (stance - q) - kd * qd).clamp(-100.0, 100.0))

        for _ in range(3):  # JIT compile / warm caches
            pd_step()
        t = time.perf_counter()
        for _ in range(steps):
            pd_step()
        return num_envs * steps / (time.perf_counter() - t)
    finally:
        sim.close()
