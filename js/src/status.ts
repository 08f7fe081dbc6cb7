import { ISessionContext } from '@jupyterlab/apputils';
import { Kernel, KernelMessage } from '@jupyterlab/services';
import { ISignal, Signal } from '@lumino/signaling';
import { Widget } from '@lumino/widgets';

import { kernelGone, statusText, statusTooltip } from './format';
import { IHost, KernelChange } from './hosts';
import {
  FreshOutputs,
  FrontendRequest,
  ISidebarAnswer,
  IStatusPayload,
  KEEPALIVE_MS,
  readStatusComm,
  sidebarOutputModelId,
  STATUS_TARGET
} from './protocol';

/**
 * The status comm of one notebook or console.
 *
 * The comm is opened from either side:
 * - the kernel opens it when gpumem is loaded (this front end registers the
 *   target on every kernel connection);
 * - the front end opens it when it connects to a kernel and after each
 *   execution, but only once the kernel lists an open `gpumem.status` comm
 *   (comm_info_request) or the executed code mentions gpumem. Opening a comm
 *   to a target the kernel does not know would log an error in the kernel.
 */
export class StatusConnection {
  constructor(readonly host: IHost) {
    const ctx = host.sessionContext;
    ctx.kernelChanged.connect(this._onKernelChanged, this);
    ctx.statusChanged.connect(this._onStatusChanged, this);
    ctx.iopubMessage.connect(this._onIOPub, this);
    this._setKernel(ctx.session?.kernel ?? null);
    this._keepalive = window.setInterval(() => {
      if (this.isConnected) {
        this._send({ request: 'keepalive' });
      }
    }, KEEPALIVE_MS);
  }

  /** Emitted when the payload or the connection state changes. */
  get changed(): ISignal<this, void> {
    return this._changed;
  }

  /** Emitted when the kernel answers a sidebar request. */
  get sidebarAnswered(): ISignal<this, ISidebarAnswer> {
    return this._sidebarAnswered;
  }

  /** The latest status payload, null while not connected. */
  get payload(): IStatusPayload | null {
    return this._comm ? this._payload : null;
  }

  get isConnected(): boolean {
    return this._comm !== null && !this._comm.isDisposed;
  }

  get isDisposed(): boolean {
    return this._disposed;
  }

  text(): string | null {
    const payload = this.payload;
    return payload ? statusText(payload) : null;
  }

  tooltip(): string {
    const payload = this.payload;
    return payload ? statusTooltip(payload, this.host.name()) : '';
  }

  /**
   * Whether a `%gpumem sidebar` output with `modelId` just arrived from this
   * kernel (as opposed to one restored from the saved notebook). Answers true
   * once per output.
   */
  takeFreshOutput(modelId: string): boolean {
    return this._freshOutputs.take(modelId);
  }

  /** Whether an output with `modelId` arrived and was not taken yet. */
  hasFreshOutput(modelId: string): boolean {
    return this._freshOutputs.has(modelId);
  }

  /**
   * Whether the kernel says `modelId` is its live sidebar panel: answered by
   * the first status payload (now, or once the comm connects), false after
   * `timeoutMs` without one.
   */
  showsLivePanel(modelId: string, timeoutMs: number): Promise<boolean> {
    return new Promise<boolean>(resolve => {
      let timer = 0;
      const finish = (live: boolean) => {
        window.clearTimeout(timer);
        this._changed.disconnect(check);
        resolve(live);
      };
      const check = () => {
        const payload = this.payload;
        if (payload) {
          finish(payload.docked_model_id === modelId);
        } else if (this._absent) {
          finish(false); // the kernel has no gpumem status comm: nothing of it is live
        }
      };
      timer = window.setTimeout(() => finish(false), timeoutMs);
      this._changed.connect(check);
      check();
    });
  }

  /** Ask the kernel for a panel to dock; false when there is no comm. */
  requestSidebar(): boolean {
    const sent = this._send({ request: 'sidebar' });
    console.debug(`gpumem: sidebar request on ${this._comm?.commId}: ${sent}`);
    return sent;
  }

  dispose(): void {
    if (this._disposed) {
      return;
    }
    this._disposed = true;
    window.clearInterval(this._keepalive);
    const ctx = this.host.sessionContext;
    ctx.kernelChanged.disconnect(this._onKernelChanged, this);
    ctx.statusChanged.disconnect(this._onStatusChanged, this);
    ctx.iopubMessage.disconnect(this._onIOPub, this);
    this._setKernel(null);
    Signal.clearData(this);
  }

  private _send(data: FrontendRequest): boolean {
    const comm = this._comm;
    if (!comm || comm.isDisposed) {
      return false;
    }
    try {
      comm.send(data);
      return true;
    } catch (reason) {
      console.warn('gpumem: status comm send failed', reason);
      this._drop(comm);
      return false;
    }
  }

  private _setKernel(kernel: Kernel.IKernelConnection | null): void {
    if (kernel === this._kernel) {
      return;
    }
    if (this._kernel && !this._kernel.isDisposed) {
      this._kernel.removeCommTarget(STATUS_TARGET, this._onKernelComm);
      this._kernel.anyMessage.disconnect(this._onAnyMessage, this);
    }
    this._closeComm();
    this._freshOutputs.clear();
    this._absent = false;
    this._kernel = kernel;
    console.debug(
      `gpumem: ${this.host.name()} kernel connection ${kernel?.id ?? 'none'}`
    );
    if (kernel) {
      kernel.registerCommTarget(STATUS_TARGET, this._onKernelComm);
      kernel.anyMessage.connect(this._onAnyMessage, this);
      // At connect: the kernel may already run gpumem (page reload, second tab).
      void this._probe(false);
    }
  }

  private _onKernelChanged(_: ISessionContext, args: KernelChange): void {
    this._setKernel(args.newValue);
  }

  private _onStatusChanged(_: ISessionContext, status: Kernel.Status): void {
    if (kernelGone(status) !== null) {
      // A restarted kernel starts without gpumem: forget the dead comm.
      this._closeComm(false);
    }
  }

  /**
   * Emitted synchronously when a message arrives, before any output is
   * rendered: outputs seen here come from a live execution.
   */
  private _onAnyMessage(
    _: Kernel.IKernelConnection,
    args: Kernel.IAnyMessageArgs
  ): void {
    const msg = args.msg;
    if (args.direction !== 'recv' || msg.channel !== 'iopub') {
      return;
    }
    const modelId = sidebarOutputModelId(msg.header.msg_type, msg.content);
    if (modelId !== null) {
      this._freshOutputs.add(modelId);
    }
  }

  private _onIOPub(_: ISessionContext, msg: KernelMessage.IMessage): void {
    if (this.isConnected) {
      return;
    }
    if (msg.header.msg_type === 'execute_input') {
      const code = (msg as KernelMessage.IExecuteInputMsg).content.code ?? '';
      if (code.includes('gpumem')) {
        this._mentioned = true;
      }
    } else if (msg.header.msg_type === 'status') {
      const state = (msg as KernelMessage.IStatusMsg).content.execution_state;
      const parent = msg.parent_header;
      const parentType = 'msg_type' in parent ? parent.msg_type : undefined;
      if (state === 'idle' && parentType === 'execute_request') {
        const direct = this._mentioned;
        this._mentioned = false;
        void this._probe(direct);
      }
    }
  }

  /**
   * Try to open the comm. With `direct` false, only when the kernel already
   * has a comm of our target open (it then certainly knows the target).
   */
  private async _probe(direct: boolean): Promise<void> {
    const kernel = this._kernel;
    if (
      !kernel ||
      this._probing === kernel ||
      this.isConnected ||
      this._disposed
    ) {
      return;
    }
    this._probing = kernel;
    try {
      if (!direct) {
        if (kernel.status === 'unknown' || kernel.status === 'starting') {
          await this.host.sessionContext.ready;
        }
        if (kernel !== this._kernel || kernel.isDisposed) {
          return;
        }
        const reply = await kernel.requestCommInfo({
          target_name: STATUS_TARGET
        });
        const content = reply.content;
        const found =
          content.status === 'ok' ? Object.keys(content.comms).length : 0;
        console.debug(`gpumem: kernel ${kernel.id} has ${found} status comms`);
        if (!found) {
          if (kernel === this._kernel && !this._absent) {
            this._absent = true;
            this._changed.emit();
          }
          return;
        }
      }
      if (kernel !== this._kernel || kernel.isDisposed || this.isConnected) {
        return;
      }
      const comm = kernel.createComm(STATUS_TARGET);
      this._adopt(comm, true);
      comm.open({ request: 'snapshot' });
    } catch (reason) {
      // The kernel may be restarting or not speak the comm protocol.
      console.debug('gpumem: status comm not opened', reason);
    } finally {
      if (this._probing === kernel) {
        this._probing = null;
      }
    }
  }

  private _onKernelComm = (
    comm: Kernel.IComm,
    msg: KernelMessage.ICommOpenMsg
  ): void => {
    if (this.isConnected || this._disposed) {
      // One comm is enough. Not closed: the kernel keeps its own comm open as
      // a beacon for front ends that connect later.
      comm.dispose();
      return;
    }
    this._adopt(comm, false);
    this._onData(msg.content.data);
    // Confirms to the kernel that a front end listens on this comm.
    this._send({ request: 'snapshot' });
  };

  private _adopt(comm: Kernel.IComm, owned: boolean): void {
    console.debug(`gpumem: status comm ${comm.commId} adopted`);
    this._absent = false;
    this._comm = comm;
    this._owned = owned;
    comm.onMsg = msg => this._onData(msg.content.data);
    comm.onClose = () => this._drop(comm);
  }

  private _onData(data: unknown): void {
    const message = readStatusComm(data);
    if (message?.kind === 'status') {
      this._payload = message.payload;
      this._changed.emit();
      return;
    }
    console.debug('gpumem: status comm message', JSON.stringify(data));
    if (message?.kind === 'sidebar') {
      this._sidebarAnswered.emit(message.answer);
    }
  }

  private _drop(comm: Kernel.IComm): void {
    console.debug(`gpumem: status comm ${comm.commId} closed`);
    if (this._comm !== comm) {
      return;
    }
    this._comm = null;
    this._payload = null;
    this._changed.emit();
  }

  /**
   * Forget the comm. With `notify`, tell the kernel that this front end stops
   * listening (also when the page goes away: its widget views are never
   * removed one by one then, and the kernel stops counting them): close the
   * comm when this front end opened it, else say `bye` on it (the kernel's
   * beacon comm stays open).
   */
  private _closeComm(notify = true): void {
    const comm = this._comm;
    if (!comm) {
      return;
    }
    this._comm = null;
    this._payload = null;
    if (notify && !comm.isDisposed) {
      try {
        if (this._owned) {
          comm.close();
        } else {
          const bye: FrontendRequest = { request: 'bye' };
          comm.send(bye);
        }
      } catch {
        // the kernel is gone
      }
    }
    if (!comm.isDisposed) {
      comm.dispose();
    }
    this._changed.emit();
  }

  private _kernel: Kernel.IKernelConnection | null = null;
  private _comm: Kernel.IComm | null = null;
  private _owned = false;
  private _payload: IStatusPayload | null = null;
  private _freshOutputs = new FreshOutputs();
  private _keepalive = 0;
  private _probing: Kernel.IKernelConnection | null = null;
  private _mentioned = false;
  /** The kernel was asked and had no gpumem status comm (gpumem not loaded there). */
  private _absent = false;
  private _disposed = false;
  private _changed = new Signal<this, void>(this);
  private _sidebarAnswered = new Signal<this, ISidebarAnswer>(this);
}

/** The status-bar item: the active document's kernel figures. */
export class StatusItem extends Widget {
  constructor(onClick: () => void) {
    super({ node: document.createElement('div') });
    this.addClass('gpumem-StatusItem');
    this.addClass('jp-StatusBar-TextItem');
    this.node.setAttribute('role', 'button');
    this.node.tabIndex = 0;
    this.node.addEventListener('click', onClick);
    this.node.addEventListener('keydown', event => {
      if (event.key === 'Enter' || event.key === ' ') {
        onClick();
      }
    });
  }

  display(connection: StatusConnection | null): void {
    const text = connection?.text() ?? null;
    this.node.textContent = text ?? '';
    this.node.title = connection && text ? connection.tooltip() : '';
  }
}
