import { IRenderMime } from '@jupyterlab/rendermime-interfaces';
import { Message } from '@lumino/messaging';
import { PromiseDelegate } from '@lumino/coreutils';
import { Widget } from '@lumino/widgets';

import { Hosts, IHost } from './hosts';
import { readSidebarData, SIDEBAR_MIME } from './protocol';
import { SidebarController } from './sidebar';

/** How long to wait for the output to be attached before guessing its host. */
const ATTACH_TIMEOUT_MS = 3000;

/** Whether `host`'s kernel just sent an output docking `modelId` (once). */
export type FreshOutputCheck = (
  host: IHost,
  modelId: string,
  take: boolean
) => boolean;

/**
 * Whether `modelId` is the live sidebar panel of `host`'s running kernel, as
 * its status comm says (false when the kernel does not answer in time).
 */
export type LivePanelCheck = (host: IHost, modelId: string) => Promise<boolean>;

const DOCKED_TEXT = 'GPU memory panel docked in the right sidebar.';

/**
 * Renders a `%gpumem sidebar` output: a one-line note in the cell, and docks
 * the panel in the sidebar.
 *
 * Only an output that just arrived from a kernel docks by itself; an output
 * restored from a saved notebook only offers a button, because its widget
 * may belong to a kernel that is gone.
 */
export class SidebarNoteRenderer
  extends Widget
  implements IRenderMime.IRenderer
{
  constructor(
    options: IRenderMime.IRendererOptions,
    private _controller: SidebarController,
    private _hosts: Hosts,
    private _isFresh: FreshOutputCheck,
    private _isLive: LivePanelCheck
  ) {
    super();
    this._mimeType = options.mimeType;
    this.addClass('gpumem-SidebarNote');
  }

  // async: the interface asks for a promise, and a throw here becomes its rejection.
  // eslint-disable-next-line @typescript-eslint/require-await
  async renderModel(model: IRenderMime.IMimeModel): Promise<void> {
    const modelId = readSidebarData(model.data[this._mimeType]);
    this.node.textContent = '';
    if (modelId === null) {
      this.node.textContent = 'gpumem: malformed sidebar output (no model id).';
      return;
    }
    const text = document.createElement('span');
    text.className = 'gpumem-SidebarNote-text';
    text.textContent = 'GPU memory panel: looking for its kernel…';
    const button = document.createElement('button');
    button.className =
      'gpumem-SidebarNote-button jp-Button jp-mod-styled jp-mod-accept';
    button.textContent = 'Show sidebar';
    this.node.append(text, ' ', button);

    void this._locate(modelId).then(async host => {
      // Fresh from the kernel, or restored (a reload, a new window) while its kernel still shows it.
      const live =
        host !== null &&
        (this._isFresh(host, modelId, true) ||
          (await this._isLive(host, modelId)));
      if (this.isDisposed) {
        return;
      }
      if (host && live) {
        text.textContent = DOCKED_TEXT;
        this._controller.dock(host, modelId);
      } else {
        text.textContent = host
          ? 'GPU memory panel of an earlier run: dock it again if its kernel still runs, or run %gpumem sidebar.'
          : 'GPU memory panel (its notebook could not be found).';
        button.textContent = 'Dock in sidebar';
      }
      button.addEventListener('click', () => {
        const target = host ?? this._hosts.containing(this.node);
        if (!target || this._controller.isDocked(target, modelId)) {
          this._controller.show();
        } else {
          this._controller.dock(target, modelId);
        }
      });
    });
  }

  protected onAfterAttach(msg: Message): void {
    super.onAfterAttach(msg);
    this._attached.resolve();
  }

  /** The notebook or console holding this output. */
  private async _locate(modelId: string): Promise<IHost | null> {
    // The kernel that just sent this output, when only one did.
    const senders = this._hosts
      .all()
      .filter(h => this._isFresh(h, modelId, false));
    if (senders.length === 1) {
      return senders[0];
    }
    if (!this.isAttached) {
      let timer = 0;
      const timeout = new Promise<void>(resolve => {
        timer = window.setTimeout(resolve, ATTACH_TIMEOUT_MS);
      });
      await Promise.race([this._attached.promise, timeout]);
      window.clearTimeout(timer);
    }
    if (this.isDisposed) {
      return null;
    }
    return this._hosts.containing(this.node);
  }

  private _mimeType: string;
  private _attached = new PromiseDelegate<void>();
}

/** The rendermime factory for SIDEBAR_MIME. */
export function sidebarRendererFactory(
  controller: SidebarController,
  hosts: Hosts,
  isFresh: FreshOutputCheck,
  isLive: LivePanelCheck
): IRenderMime.IRendererFactory {
  return {
    safe: false,
    mimeTypes: [SIDEBAR_MIME],
    createRenderer: options =>
      new SidebarNoteRenderer(options, controller, hosts, isFresh, isLive)
  };
}

export { SIDEBAR_MIME };
